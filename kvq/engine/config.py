"""What an engine is asked for, checked and resolved before anything heavy is built.

:class:`EngineConfig` range-checks every choice when it is made (ValueError naming what is valid);
the helpers below resolve what depends on the machine (device, dtype, threads, memory that fits).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from kvq.attention.backends import PREFILL_NAMES, backend_names
from kvq.cache.plan import KVCacheConfig
from kvq.engine.scheduling import PREEMPTION_MODES
from kvq.models.builder import LOAD_FORMATS
from kvq.units import format_bytes, parse_bytes

DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
#: torch CPU threads when ``threads`` is None on a CPU device and OMP_NUM_THREADS is unset.  Measured
#: on SmolLM2-135M shapes: one thread is never much slower than on an idle machine, while more threads
#: than free cores stall at every op's barrier (shared 2-core machine: 2 threads 3-13x slower than 1;
#: 16 cores all busy: 4 threads 3x slower on a 1000-token prefill, 8 threads 17x slower decoding).  On
#: an idle 16-core machine 4-8 threads are 1.6-5x faster: ``threads=N`` / ``--threads N`` there.
DEFAULT_CPU_THREADS = 1
CPU_DEFAULT_KV_MEMORY = "1GiB"


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"
    kv_cache_dtype: str = "auto"
    kv_cache_dtype_k: str | None = None
    kv_cache_dtype_v: str | None = None
    kv_cache_dtype_skip_layers: tuple = ()
    kv_sink_tokens: int | None = None
    kv_residual_tokens: int | None = None
    kivi_group_size: int | None = None
    block_size: int | None = None
    kv_cache_plan: str | None = None  # a plan file (`kvq tune`): formats per layer and K/V, windows
    # elastic precision (kvq.cache.tiers): formats sealed blocks move down to, by age and/or under pressure
    kv_cache_tiers: tuple[str, ...] | str = ()
    kv_tier_age: tuple[int, ...] | str | int = ()
    kv_tier_policy: tuple[str, ...] | str = ()
    attention_backend: str = "auto"
    prefill_backend: str = "auto"  # the prefill attention kernel (kvq.attention.backends.select_prefill)
    device: str = "auto"  # cuda if available, else cpu
    dtype: str = "auto"  # bfloat16 on cuda, float32 on cpu
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory: str | int | None = None  # bytes for the KV pools; default: 1GiB on cpu, from utilization on cuda
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    seed: int = 0
    progress: bool = True
    freeze_gc: bool | None = None  # gc.freeze() once built, a higher gen-0 threshold (default: on CUDA); LLMEngine
    # schedule and launch step N+1 before step N's results are read (default: on CUDA, where the device
    # runs one step while the host prepares the next; off on the CPU, where nothing overlaps)
    async_scheduling: bool | None = None
    kv_cache: KVCacheConfig | None = None  # the KV choices as one object (instead of the kv_* fields above)
    # torch CPU threads for this process: N >= 1 sets it, 0 keeps torch's own; None: DEFAULT_CPU_THREADS
    # on a CPU device unless OMP_NUM_THREADS is set, torch's own on CUDA
    threads: int | None = None
    # what a preempted request becomes: "recompute" (its KV dropped, prefilled again) or "swap" (its
    # blocks parked in a host tier of cpu_offload_gb GiB, resumed before new admissions)
    preemption_mode: str = "recompute"
    cpu_offload_gb: float = 0.0
    # the CPU prefix tier: full computed blocks kept in host memory by prefix hash after their request
    # ends, loaded back on a device prefix miss (None: on when cpu_offload_gb > 0 and prefix caching is on;
    # with preemption_mode "swap" too, swap and the tier get half of cpu_offload_gb each)
    cpu_prefix_cache: bool | None = None
    # static KV scales (formats with static scales: fp8_e4m3, fp8_e5m2): None = 1.0, or a file written
    # by `kvq calibrate` (kvq.cache.scales_file), checked against the model and plan before the load
    kv_scales: str | None = None
    # tensor parallelism (kvq.parallel): ranks over torch.distributed, NCCL on CUDA (one GPU each:
    # cuda:0..N-1, or LOCAL_RANK under torchrun), gloo on the CPU; a rank that does not answer a
    # collective within distributed_timeout_s seconds fails the engine
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        """Every choice range-checked here, before a model file is opened (ValueError naming what is
        valid); what needs the model's shape (max_model_len, skipped layers) is checked next, still
        before the weights load."""
        if self.kv_cache is not None and self.kv_cache_config_fields() != KVCacheConfig():
            raise ValueError("give the KV cache choices either as kv_cache=KVCacheConfig(...) or as the "
                             "kv_cache_dtype* / kv_*_tokens / kivi_group_size / block_size / kv_cache_plan fields, not both")  # noqa: E501
        if self.kv_cache is not None and not isinstance(self.kv_cache, KVCacheConfig):
            raise ValueError(f"kv_cache must be a KVCacheConfig, got {type(self.kv_cache).__name__}")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(f"model must be 'default', a shipped config, a .gguf path or an HF folder, "
                             f"got {self.model!r}")
        if isinstance(self.device, torch.device):
            object.__setattr__(self, "device", str(self.device))
        check_device_name(self.device)
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPES)}")
        if self.attention_backend not in backend_names():
            raise ValueError(f"unknown attention backend {self.attention_backend!r}; "
                             f"valid: {', '.join(backend_names())}")
        if self.prefill_backend not in PREFILL_NAMES:
            raise ValueError(f"unknown prefill backend {self.prefill_backend!r}; valid: {', '.join(PREFILL_NAMES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load format {self.load_format!r}; valid: {', '.join(LOAD_FORMATS)}")
        _check_int("max_model_len", self.max_model_len, 1, optional=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence decodes one token each step")
        _check_int("seed", self.seed, None)
        _check_int("threads", self.threads, 0, optional=True)
        if self.kv_cache_memory is not None:
            if isinstance(self.kv_cache_memory, bool):
                raise ValueError(f"kv_cache_memory must be a size such as 4GiB, got {self.kv_cache_memory!r}")
            try:
                parse_bytes(self.kv_cache_memory)
            except (ValueError, TypeError) as e:
                raise ValueError(f"kv_cache_memory: {e}") from None
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:  # rejects NaN too
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("freeze_gc", "async_scheduling"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be True, False or None (the device's default), "
                                 f"got {getattr(self, name)!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption_mode {self.preemption_mode!r}; valid: {', '.join(PREEMPTION_MODES)}")
        g = self.cpu_offload_gb
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < float("inf"):
            raise ValueError(f"cpu_offload_gb must be a number of GiB >= 0, got {g!r}")
        if self.preemption_mode == "swap" and g <= 0:
            raise ValueError("preemption_mode 'swap' needs a host tier: cpu_offload_gb > 0 (--cpu-offload-gb)")
        if self.cpu_prefix_cache not in (None, True, False):
            raise ValueError(f"cpu_prefix_cache must be True, False or None (on when cpu_offload_gb > 0 and "
                             f"prefix caching is on), got {self.cpu_prefix_cache!r}")
        if self.cpu_prefix_cache and g <= 0:
            raise ValueError("cpu_prefix_cache needs host memory: cpu_offload_gb > 0 (--cpu-offload-gb)")
        from kvq.cache.scales_warmup import parse_warmup

        if parse_warmup(self.kv_scales) and g > 0:  # ValueError for a bad warmup:N too
            raise ValueError("kv_scales warmup re-encodes the device cache when the scales freeze; a host tier "
                             "(cpu_offload_gb > 0) would keep blocks written under scale 1.0: use a scales file "
                             "(`kvq calibrate`) with cpu_offload_gb")
        if self.cpu_prefix_cache and not self.enable_prefix_caching:
            raise ValueError("cpu_prefix_cache keeps prefix-cached blocks: it needs enable_prefix_caching")
        self._check_parallel()

    def _check_parallel(self) -> None:
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        t = self.distributed_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"distributed_timeout_s must be a number of seconds > 0, got {t!r}")
        if self.tensor_parallel_size == 1:
            return
        from kvq.cache.scales_warmup import parse_warmup

        n = self.tensor_parallel_size
        unsupported = {"cpu_offload_gb > 0 (a host tier)": self.cpu_offload_gb > 0,
                       "async_scheduling": self.async_scheduling is True,
                       "kv_scales warmup": bool(parse_warmup(self.kv_scales)),
                       f"device {self.device!r} (tensor parallel ranks take cuda:0..{n - 1}; use cuda or auto)":
                       re.fullmatch(r"cuda:\d+", self.device) is not None}
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"tensor_parallel_size {n} does not work with {', '.join(bad)} yet")

    @property
    def uses_cpu_prefix_cache(self) -> bool:
        """Whether the engine keeps a CPU prefix tier (the resolved ``cpu_prefix_cache``)."""
        if self.cpu_prefix_cache is not None:
            return self.cpu_prefix_cache
        return self.cpu_offload_gb > 0 and self.enable_prefix_caching

    def kv_cache_config_fields(self) -> KVCacheConfig:
        return KVCacheConfig(dtype=self.kv_cache_dtype, k=self.kv_cache_dtype_k, v=self.kv_cache_dtype_v,
                             skip_layers=tuple(self.kv_cache_dtype_skip_layers), sink_tokens=self.kv_sink_tokens,
                             residual_tokens=self.kv_residual_tokens, group_size=self.kivi_group_size,
                             block_size=self.block_size, plan_file=self.kv_cache_plan, tiers=self.kv_cache_tiers,
                             tier_age=self.kv_tier_age, tier_policy=self.kv_tier_policy)

    @property
    def kv_cache_config(self) -> KVCacheConfig:
        """The KV choices as one object: ``kv_cache`` if given, else the vLLM-style fields."""
        return self.kv_cache if self.kv_cache is not None else self.kv_cache_config_fields()


def _check_int(name: str, value, low: int | None, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        raise ValueError(f"{name} must be an int" + (f" >= {low}" if low is not None else "") + f", got {value!r}")


def check_device_name(name) -> None:
    """ValueError unless ``name`` is one of :data:`DEVICES` (whether CUDA exists is checked at start)."""
    if not isinstance(name, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise ValueError(f"unknown device {name!r}; valid: {', '.join(DEVICES)}")


def resolve_device(name: str) -> torch.device:
    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but no CUDA device is available (valid here: cpu, auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return dev


def resolve_threads(threads: int | None, device: torch.device) -> int | None:
    """The torch CPU thread count an engine sets (None: leave torch's as it is)."""
    if threads is None:
        if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
            return None
        return DEFAULT_CPU_THREADS
    return threads or None


def available_host_memory() -> int | None:
    """Bytes of RAM this process can still take: the smaller of the machine's available memory and
    the cgroup's limit (containers); None where neither can be read."""
    found = []
    try:
        import psutil

        found.append(int(psutil.virtual_memory().available))
    except ImportError:
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            found.append(int(info["MemAvailable"].split()[0]) * 1024)
        except (OSError, KeyError, ValueError):
            try:
                found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
            except (ValueError, OSError, AttributeError):
                pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_memory_fits(nbytes: int, device: torch.device, what: str = "kv_cache_memory") -> None:
    """ValueError if a KV budget (``what``) cannot exist on ``device`` (before anything is loaded)."""
    flag = "--" + what.replace("_", "-")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if nbytes > free:
            raise ValueError(f"{what} {format_bytes(nbytes)} exceeds the {format_bytes(free)} free on "
                             f"{device} ({format_bytes(total)} total, before the model loads)")
        return
    avail = available_host_memory()
    if avail is not None and nbytes > avail:
        raise ValueError(f"{what} {format_bytes(nbytes)} exceeds the {format_bytes(avail)} of RAM "
                         f"available to this process (before the model loads); give a smaller {flag}")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[name] or (torch.bfloat16 if device.type == "cuda" else torch.float32)
