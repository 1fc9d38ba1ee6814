"""benchmarks/sim_pressure.py: the wave under memory pressure, simulated with the real scheduler and block manager."""

import json

from benchmarks import sim_pressure


def test_a_ladder_keeps_more_requests_running_than_its_resident_format(tmp_path):
    # 8 requests of 256 + 512 tokens in what an H100's pool gives each of 1280: fp8_e4m3 alone preempts
    out = tmp_path / "sim.json"
    assert sim_pressure.main(["--concurrency", "8", "--input-len", "256", "--output-len", "512", "--h100-requests",
                              "1280", "--configs", "fp8_e4m3,fp8_e4m3>int4_kivi", "--out", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    alone, ladder = rows["fp8_e4m3"], rows["fp8_e4m3>int4_kivi"]
    assert alone["preemptions"] > 0 and alone["running_mean"] < 8
    # demoting cold blocks keeps the wave together: fewer steps, more requests running on average
    assert ladder["steps"] < alone["steps"] and ladder["running_mean"] > alone["running_mean"]
    assert ladder["pool_hp_blocks"] == 0  # KIVI's windows stay in fp8_e4m3, not in bf16
    # a second run with other settings adds its rows to the file
    sim_pressure.main(["--concurrency", "4", "--input-len", "64", "--output-len", "64", "--configs", "fp8_e4m3",
                       "--out", str(out)])
    assert len(json.loads(out.read_text())["rows"]) == 3


def test_pressure_with_bf16_windows_preempts_less_than_the_windows_alone(tmp_path):
    """12 requests of 1024 + 2048 tokens: fp8_e4m3 with KIVI's bf16 windows preempts (45 times when
    written); with an int4_kivi tier under pressure it must preempt less, in fewer steps.  (The slab wipe's
    first rule, which kept every slab that left a tier that step from the others, made pressure find no room
    here: 1359 preemptions.)"""
    out = tmp_path / "sim.json"
    assert sim_pressure.main(["--concurrency", "12", "--configs", "fp8_e4m3:r128:s4,fp8_e4m3:r128:s4>int4_kivi",
                              "--out", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    alone, ladder = rows["fp8_e4m3:r128:s4"], rows["fp8_e4m3:r128:s4>int4_kivi"]
    assert alone["preemptions"] > 0
    assert ladder["preemptions"] < alone["preemptions"] and ladder["steps"] < alone["steps"], (alone, ladder)
