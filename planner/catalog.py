"""Catalogs: models from Hugging Face ``config.json`` files, clusters from machine YAMLs.

``load_model`` takes a catalog name (``models/<name>.json``), a path to a ``config.json``, or a
dict (a Hugging Face config, or ``ModelSpec`` fields). It reads the Llama, Mistral, Mixtral,
Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, DeepSeek-V2/V3, Kimi K2, gpt-oss, GPT-2 and GPT-NeoX formats;
a field that would change the cost and that its reader does not cost is refused, never ignored
(``planner.configs.model_from_config``). ``load_cluster`` takes a machine name
(``hardware/<name>.yaml``) or a path, and the total GPU count. Units are converted once, here:
the YAML says GiB, GB/s, Gb/s and TFLOP/s in its key names; specs hold bytes, B/s and FLOP/s.
A machine YAML's keys, and ``models/index.yaml``'s, are checked: an unknown key (a typo) is an
error naming the file, the key and the keys allowed, never a figure left at its default. The
catalog folders are wherever ``planner.data`` finds them: in an installed wheel or a checkout.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import yaml

from planner.configs import language_model_only as _language_model_only
from planner.configs import model_from_config
from planner.data import catalog_dir
from planner.errors import PlannerError, UnknownNameError
from planner.specs import MAX_GPUS, ClusterSpec, ModelSpec

MODELS_DIR = catalog_dir("models")
HARDWARE_DIR = catalog_dir("hardware")
GiB = 2**30


def model_names() -> list[str]:
    """Names the model catalog holds."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def cluster_names() -> list[str]:
    """Machine types the hardware catalog holds."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


# What ``models/index.yaml`` says of each model file: where it came from and what was
# checked. The Megatron-LM export reads ``source`` (the Hugging Face repository, for the
# tokenizer), so a misspelt key is refused rather than read as no source.
INDEX_KEYS = (
    "file",
    "source",
    "format",
    "model_chosen",
    "shape_source",
    "vendored_copy",
    "cross_checked_against",
    "published_total_params",
    "published_total_params_source",
    "hf_safetensors_total",
    "notes",
)


@functools.cache
def model_index(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """``models/index.yaml`` (or the index at ``path``), each model's entry's keys checked
    against ``INDEX_KEYS``."""
    path = path or MODELS_DIR / "index.yaml"
    index = _read(path)
    for name, entry in index.items():
        check_keys(entry, INDEX_KEYS, file=f"model index {path}", where=str(name))
    return index


def load_model(source: str | Path | dict[str, Any]) -> ModelSpec:
    """A ``ModelSpec`` from a catalog name, a path to a config file, or a dict."""
    if isinstance(source, dict):
        return model_from_config(source, name=str(source.get("name", "custom")))
    path = resolve_source(source, MODELS_DIR, ".json", "model", model_names())
    named = path == MODELS_DIR / f"{source}.json"
    return model_from_config(_read(path), name=str(source) if named else str(path))


def language_model_only(source: str | Path) -> bool:
    """Whether the model config ``source`` (a catalog name or a path) is multimodal, its
    language model alone read: its vision tower is neither counted nor planned."""
    path = resolve_source(source, MODELS_DIR, ".json", "model", model_names())
    return _language_model_only(_read(path))


# A machine YAML's keys: a misspelt one would leave its figure at a default (PCIe at 100% of
# peak, say), so anything else is refused. The measured figures, each with a source:
MACHINE_FIELDS = (
    "gpus_per_node",
    "nvlink_domain_gpus",
    "hbm_GiB",
    "usable_hbm_GiB",
    "hbm_bandwidth_GBps",
    "sm_count",
    "bf16_dense_tflops",
    "fp8_dense_tflops",
    "fp32_tflops",
    "nvlink_GBps_per_direction",
    "nvlink_peer_GBps_per_direction",
    "nics_per_node",
    "nic_Gbps",
    "host_ram_GiB",
    "pcie_GBps_per_direction",
    "gpu_nic_GBps_per_direction",
    "host_memory_GBps",
    "nvlink_latency_us",
    "ib_latency_us",
    "kernel_overhead_us",
    "host_overhead_us",
    "sustained_tensor_rate",
    "framework_host_overhead_us",
    "framework_fragmentation",
    "framework_buffers_at_peak",
)
MACHINE_KEYS = (
    "name",
    "description",
    *MACHINE_FIELDS,
    "achieved",
    "achieved_max",
    "sources",
    "checks",  # the block timings ``planner calibrate`` measured against the model (it shows them)
)
# The fractions of peak the cost model reads from ``achieved``: costs/compute.py (gemm,
# gemm_fp8, attention, attention_fa2, memory_bound, pcie), costs/comm.py (nvlink, ib),
# costs/timing.py (host_memory).
ACHIEVED_KINDS = (
    "gemm",
    "gemm_fp8",
    "attention",
    "attention_fa2",
    "memory_bound",
    "nvlink",
    "ib",
    "pcie",
    "host_memory",
)
# The fractions fit.py fits, each capped by ``achieved_max``.
ACHIEVED_MAX_KINDS = ("gemm", "attention", "memory_bound", "nvlink", "ib")
# ``sources`` cites each figure by its key; ``fit`` is the note of ``planner calibrate --runs``.
SOURCE_KEYS = (
    *MACHINE_FIELDS,
    *(f"achieved.{kind}" for kind in ACHIEVED_KINDS),
    *(f"achieved_max.{kind}" for kind in ACHIEVED_MAX_KINDS),
    "fit",
)


def check_keys(data: Any, allowed: tuple[str, ...], *, file: str, where: str = "") -> None:
    """A one-line error naming ``file``, the first key of ``data`` not ``allowed`` (in the
    section ``where``) and the allowed keys: a catalog file's typo fails rather than reading
    as a missing, defaulted figure."""
    if not isinstance(data, dict):
        at = f"{where}={data!r}" if where else "the top level"
        raise PlannerError(f"{file}: {at}: expected a mapping of keys")
    unknown = sorted(str(key) for key in data if key not in allowed)
    if unknown:
        section = f" in {where}" if where else ""
        raise PlannerError(
            f"{file}: unknown key {unknown[0]!r}{section}; allowed: {', '.join(allowed)}"
        )


def _check_machine(data: dict[str, Any], path: Path) -> None:
    """Every key of a machine YAML is one ``load_cluster`` reads or a source cites."""
    file = f"cluster file {path}"
    check_keys(data, MACHINE_KEYS, file=file)
    sections = (
        ("achieved", ACHIEVED_KINDS),
        ("achieved_max", ACHIEVED_MAX_KINDS),
        ("sources", SOURCE_KEYS),
    )
    for section, allowed in sections:
        if data.get(section) is not None:
            check_keys(data[section], allowed, file=file, where=section)
    sections_of_numbers = (
        "achieved",
        "achieved_max",
        "framework_host_overhead_us",
        "framework_fragmentation",
        "framework_buffers_at_peak",
    )
    numbers = [(k, data[k]) for k in MACHINE_FIELDS if k in data and k not in sections_of_numbers]
    for section in sections_of_numbers:
        numbers += [(f"{section}.{k}", v) for k, v in (data.get(section) or {}).items()]
    for key, value in numbers:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise PlannerError(f"{file}: {key}={value!r} must be a number")


def load_cluster(source: str | Path, *, gpus: int) -> ClusterSpec:
    """A ``ClusterSpec`` of ``gpus`` GPUs of the machine type ``source`` (name or YAML path)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 < gpus <= MAX_GPUS:
        raise PlannerError(f"gpus={gpus!r}: must be a whole number of GPUs from 1 to {MAX_GPUS:,}")
    path = resolve_source(source, HARDWARE_DIR, ".yaml", "cluster", cluster_names())
    data = _read(path)
    _check_machine(data, path)
    if "usable_hbm_GiB" in data and not 0 < data["usable_hbm_GiB"] <= data.get("hbm_GiB", 0):
        raise PlannerError(
            f"cluster file {path}: usable_hbm_GiB={data['usable_hbm_GiB']} must be in "
            f"(0, hbm_GiB={data.get('hbm_GiB')}] (a process cannot allocate more than the GPU has)"
        )
    try:
        achieved = data["achieved"]
        return ClusterSpec(
            name=str(data["name"]),
            num_gpus=gpus,
            gpus_per_node=data["gpus_per_node"],
            nvlink_domain_gpus=data.get("nvlink_domain_gpus"),
            hbm_bytes=round(data["hbm_GiB"] * GiB),
            hbm_bandwidth_Bps=data["hbm_bandwidth_GBps"] * 1e9,
            sm_count=data.get("sm_count"),
            bf16_flops=data["bf16_dense_tflops"] * 1e12,
            fp8_flops=(data["fp8_dense_tflops"] * 1e12) if data.get("fp8_dense_tflops") else None,
            fp32_flops=data["fp32_tflops"] * 1e12,
            nvlink_Bps=data["nvlink_GBps_per_direction"] * 1e9,
            nvlink_peer_Bps=_scaled(data, "nvlink_peer_GBps_per_direction", 1e9),
            nics_per_node=data["nics_per_node"],
            nic_Bps=data["nic_Gbps"] * 1e9 / 8,
            host_ram_bytes=round(data["host_ram_GiB"] * GiB),
            pcie_Bps=data["pcie_GBps_per_direction"] * 1e9,
            gpu_nic_Bps=_scaled(data, "gpu_nic_GBps_per_direction", 1e9),
            host_memory_Bps=(
                data["host_memory_GBps"] * 1e9 if data.get("host_memory_GBps") else None
            ),
            nvlink_latency_s=data["nvlink_latency_us"] * 1e-6,
            ib_latency_s=data["ib_latency_us"] * 1e-6,
            achieved=dict(achieved),
            achieved_max=dict(data.get("achieved_max") or {}),
            **(
                {"sustained_tensor_rate": data["sustained_tensor_rate"]}
                if data.get("sustained_tensor_rate") is not None
                else {}
            ),
            **{
                field: data[key] * 1e-6
                for field, key in (
                    ("kernel_overhead_s", "kernel_overhead_us"),
                    ("host_overhead_s", "host_overhead_us"),
                )
                if key in data
            },
            framework_host_overhead_s={
                name: float(us) * 1e-6
                for name, us in (data.get("framework_host_overhead_us") or {}).items()
            },
            framework_fragmentation=dict(data.get("framework_fragmentation") or {}),
            framework_buffers_at_peak=dict(data.get("framework_buffers_at_peak") or {}),
            # What the CUDA runtime reports as the device's total; a file without it (a
            # user's own machine) gets the nominal HBM (ClusterSpec's default).
            **(
                {
                    "hbm_reserved_bytes": round(data["hbm_GiB"] * GiB)
                    - round(data["usable_hbm_GiB"] * GiB)
                }
                if "usable_hbm_GiB" in data
                else {}
            ),
        )
    except KeyError as exc:
        raise PlannerError(f"cluster file {path}: missing key {exc.args[0]!r}") from None
    except TypeError as exc:
        raise PlannerError(f"cluster file {path}: malformed value ({exc})") from None


def _scaled(data: dict[str, Any], key: str, scale: float) -> float | None:
    """An optional machine figure in the model's units: ``data[key]`` times ``scale``, or
    None where the file leaves it out."""
    return None if data.get(key) is None else data[key] * scale


def _given(key: str, value: float | None, scale: float | None = None) -> dict[str, float]:
    """An optional machine figure as a YAML entry, times ``scale`` into the file's units
    (None: as it is, a count): none where unset."""
    if value is None:
        return {}
    return {key: value if scale is None else value * scale}


def cluster_yaml(cluster: ClusterSpec, *, sources: dict[str, str] | None = None) -> dict[str, Any]:
    """``cluster`` as a machine YAML's fields (``load_cluster``'s inverse, without the GPU
    count): what ``planner calibrate`` writes for ``--cluster``."""
    data: dict[str, Any] = {
        "name": cluster.name,
        "gpus_per_node": cluster.gpus_per_node,
        **_given("nvlink_domain_gpus", cluster.nvlink_domain_gpus),
        "hbm_GiB": cluster.hbm_bytes / GiB,
        "usable_hbm_GiB": (cluster.hbm_bytes - cluster.hbm_reserved_bytes) / GiB,
        "hbm_bandwidth_GBps": cluster.hbm_bandwidth_Bps / 1e9,
        "sm_count": cluster.sm_count,
        "bf16_dense_tflops": cluster.bf16_flops / 1e12,
        "fp8_dense_tflops": cluster.fp8_flops / 1e12 if cluster.fp8_flops else None,
        "fp32_tflops": cluster.fp32_flops / 1e12,
        "nvlink_GBps_per_direction": cluster.nvlink_Bps / 1e9,
        **_given("nvlink_peer_GBps_per_direction", cluster.nvlink_peer_Bps, 1e-9),
        "nics_per_node": cluster.nics_per_node,
        "nic_Gbps": cluster.nic_Bps * 8 / 1e9,
        "host_ram_GiB": cluster.host_ram_bytes / GiB,
        "pcie_GBps_per_direction": cluster.pcie_Bps / 1e9,
        **_given("gpu_nic_GBps_per_direction", cluster.gpu_nic_Bps, 1e-9),
        "host_memory_GBps": cluster.host_memory_Bps / 1e9 if cluster.host_memory_Bps else None,
        "nvlink_latency_us": cluster.nvlink_latency_s * 1e6,
        "ib_latency_us": cluster.ib_latency_s * 1e6,
        "kernel_overhead_us": cluster.kernel_overhead_s * 1e6,
        "host_overhead_us": cluster.host_overhead_s * 1e6,
        **_given(
            "sustained_tensor_rate",
            cluster.sustained_tensor_rate if cluster.sustained_tensor_rate < 1 else None,
        ),
        "achieved": {k: float(v) for k, v in cluster.achieved.items()},
    }
    if cluster.framework_host_overhead_s:
        data["framework_host_overhead_us"] = {
            name: _short(seconds * 1e6)
            for name, seconds in cluster.framework_host_overhead_s.items()
        }
    for key in ("framework_fragmentation", "framework_buffers_at_peak"):
        if getattr(cluster, key):
            data[key] = {name: _short(v) for name, v in getattr(cluster, key).items()}
    data = {k: _short(v) for k, v in data.items()}
    data["achieved"] = {k: _short(v) for k, v in data["achieved"].items()}
    if cluster.achieved_max:
        data["achieved_max"] = dict(cluster.achieved_max)
    if sources:
        data["sources"] = dict(sources)
    return data


def _short(value: Any) -> Any:
    """Floats to 6 significant digits (a YAML a person reads); other values as they are."""
    return float(f"{value:.6g}") if isinstance(value, float) else value


def resolve_source(
    source: str | Path, folder: Path, suffix: str, kind: str, known: list[str]
) -> Path:
    """The catalog file ``source`` names (``folder/<source><suffix>``), or ``source`` as a
    path; a one-line error listing the ``known`` names otherwise."""
    candidate = Path(source)
    named = folder / f"{source}{suffix}"
    if len(candidate.parts) == 1 and not candidate.is_file() and named.is_file():
        return named  # a catalog name with a dot in it ("qwen2.5-72b")
    if candidate.suffix == "" and not candidate.exists():
        path = folder / f"{source}{suffix}"
        if not path.exists():
            raise UnknownNameError(
                f"{kind}={str(source)!r}: unknown {kind} name; known: {', '.join(known)} "
                f"(or pass a path to a file)"
            )
        return path
    if not candidate.is_file():
        raise PlannerError(f"{kind}={str(source)!r}: no such file")
    return candidate


# libyaml's loader where PyYAML was built with it (its wheels are): the same safe subset of
# YAML, parsed in C, about ten times faster; reading the catalog's recipes is a fifth of a
# short re-plan with the pure-Python one.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load``, by libyaml where it is there."""
    return yaml.load(text, Loader=_LOADER)


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
        data = load_yaml(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise PlannerError(f"file {path}: unreadable ({exc.__class__.__name__})") from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        reason = str(exc).splitlines()[0]
        raise PlannerError(f"file {path}: malformed ({reason})") from None
    if not isinstance(data, dict):
        raise PlannerError(f"file {path}: expected a mapping at the top level")
    return data
