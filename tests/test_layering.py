"""The house stays layered (shared/DESIGN.md): no module of kvq/ imports from a floor above its own,
lazily or not, and no modules import each other round in a circle (scripts/layering.py reads the
imports with ast).  The check itself is shown to catch a planted upward import, a lazy one, a
relative one and a circle."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import layering  # noqa: E402

def test_no_upward_import_and_no_circle():
    up, circles = layering.violations(ROOT / "kvq")
    assert up == [] and circles == [], (up, circles)


def test_every_part_of_kvq_is_on_a_floor():
    for mod in layering.modules(ROOT / "kvq"):
        layering.floor_of(mod)  # KeyError names a part no floor holds


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = root / "kvq" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root / "kvq"


def test_the_check_catches_planted_upward_imports_and_circles(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "formats/__init__.py": "",
        "formats/spec.py": "def f():\n    from kvq.engine.core import step  # lazy, still upward\n",
        "cache/__init__.py": "",
        "cache/plan.py": "from ..formats import spec\nfrom ..models import llama  # relative, upward\n",
        "models/__init__.py": "",
        "models/llama.py": "import kvq.models.loader\n",
        "models/loader.py": "from kvq.models.llama import X\n",  # a circle on one floor
        "engine/__init__.py": "",
        "engine/core.py": "from kvq.cache.plan import make_plan\nfrom kvq.formats.spec import f\n",
    })
    up, circles = layering.violations(pkg)
    assert {(m, t) for m, t, _ in up} == {("kvq.formats.spec", "kvq.engine.core"),
                                          ("kvq.cache.plan", "kvq.models.llama")}
    # the lazy upward import closes a circle too: spec -> engine.core -> cache.plan -> spec
    assert circles == [["kvq.cache.plan", "kvq.engine.core", "kvq.formats.spec"],
                       ["kvq.models.llama", "kvq.models.loader"]]
    clean = _write(tmp_path / "clean", {"__init__.py": "", "formats/__init__.py": "", "formats/spec.py": "",
                                        "engine/__init__.py": "", "engine/core.py": "from kvq.formats import spec\n"})
    assert layering.violations(clean) == ([], [])


def test_docs_architecture_shows_the_declared_floors():
    assert layering.markdown() in (ROOT / "docs/architecture.md").read_text()


def test_no_file_of_kvq_over_600_lines():
    """Small files named after their concept (issue 31): a file past 600 lines holds more than one."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "kvq").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}, long
