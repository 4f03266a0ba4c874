"""DeepSpeed training logs as measured runs: ``recognises(text)`` and ``read(text, path)``.

The DeepSpeed engine run by a user script or by the Hugging Face Trainer: data parallelism
with ZeRO stage 0-3, optional ZeRO offload and ZeRO++ hierarchical partitioning, and
Ulysses sequence parallelism. Every line format is cited next to its pattern: DeepSpeed at
edaa7221 (and the releases since v0.8.0 that print the same lines), Hugging Face
transformers ``src/transformers/configuration_utils.py`` and ``training_args.py``.

What a log states and where:
- the engine's settings: ``DeepSpeedEngine configuration:`` followed by ``  <name> ....
  <value>`` lines (the resolved batch sizes, world size, ZeRO stage and precision) and
  ``  json = {...}`` (the user's config: offload, ZeRO++, sequence parallelism, data types);
- the model: transformers' ``Model config <Class> {json}`` (DeepSpeed does not know the
  architecture), read by ``planner.catalog.load_model``; a log without it is refused;
- the sequence length: DeepSpeed never logs it. It is read from a Trainer arguments dump
  (``<Class>(`` then ``name=value,`` lines, transformers' ``TrainingArguments.__str__``) of a
  TRL ``SFTConfig`` that packs its samples (``packing=True``) to ``max_length``
  (``max_seq_length`` before TRL renamed it); without one the log is refused;
- recompute: that dump's ``gradient_checkpointing`` (Hugging Face models checkpoint each
  decoder layer whole); DeepSpeed's own ``activation_checkpointing`` section applies only to
  models that call its checkpoint API and is not read;
- measurements: ``ThroughputTimer``'s ``epoch=E/micro_step=M/global_step=S,
  RunningAvgSamplesPerSec=..., CurrSamplesPerSec=C, MemAllocated=...GB,
  MaxMemAllocated=P GB`` line every ``steps_per_print`` steps, on rank 0 only (none when
  ``steps_per_print`` is unset, DeepSpeed's default since v0.15.2).

Refused in one line: a log without the model config, the sequence length, the batch sizes
(no engine dump and no json), or a steady-state ThroughputTimer line; FP32 runs; NVMe
offload; DeepSpeed's pipeline engine and tensor parallelism (``mp_world_size`` or AutoTP
above 1); ZeRO stages outside 0-3; two lines stating different values of one setting.

Step time: ``CurrSamplesPerSec`` is ``train_batch_size`` over the seconds the timer ran in
that step (deepspeed/runtime/engine.py:371-374, utils/timer.py:246-273): from each
micro-batch's forward to the optimizer step's end, so time between micro-batches outside
the engine (data loading) is not in it. One step takes ``train_batch_size / CurrSamplesPerSec``
seconds. ``MaxMemAllocated`` is the allocator's allocated peak since the process started (in
GiB, two decimals); no reserved figure is logged per step.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from planner.catalog import load_model
from planner.errors import PlannerError
from planner.layout import Layout
from planner.logs import LoggedRun
from planner.logs.text import Line, Settings, json_block, naming_the_log, streams
from planner.specs import ModelSpec, TrainingJob

GIB = 2**30
# The registry's entry for DeepSpeed running Hugging Face model code (planner.frameworks)
HF_DEEPSPEED = "hf-deepspeed"
WARMUP_STEPS = 3  # the first steps of each engine whose ThroughputTimer lines are dropped

# --- launcher and logging prefixes -------------------------------------------------------------
# Slurm's srun --label: "<task>: "; pdsh, DeepSpeed's multi-node runner
# (launcher/multinode_runner.py:55 PDSHRunner), prefixes each output line with "<host>: ";
# torchrun --tee: "[<role><local_rank>]:"
# (torch/distributed/elastic/multiprocessing/tail_log.py:130, f"[{self._name}{local_rank}]:").
_RANK = re.compile(r"^(?P<label>\s*\d+: |[A-Za-z][\w.-]*: )?(?P<header>\[[A-Za-z_]+\d+\]:)?")
# deepspeed/utils/logging.py:39-40: "[%(asctime)s] [%(levelname)s] "
# "[%(filename)s:%(lineno)d:%(funcName)s] %(message)s"
_DS_PREFIX = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[[A-Z]+\] \[[^\]]*\] ")
# transformers utils/logging.py enable_explicit_format (the example scripts call it):
# "[%(levelname)s|%(filename)s:%(lineno)s] %(asctime)s >> %(message)s"
_HF_PREFIX = re.compile(r"^\[[A-Z]+\|[^\]]+:\d+\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ >> ")
# deepspeed/utils/logging.py:108 (get_dist_msg): "[Rank {}] {}" on log_dist/print_dist lines
_DIST = re.compile(r"^\[Rank -?\d+\] ")

# --- the lines read ----------------------------------------------------------------------------
# deepspeed/runtime/engine.py:469 calls runtime/config.py:1008-1016 print(name):
# logger.info("{}:".format(name)), then per attribute logger.info("  {} {} {}".format(arg,
# "." * (29 - len(arg)), value)), then print_user_config (:998-1006):
# logger.info("  json = {}".format(json.dumps(param_dict, indent=4, cls=ScientificNotationEncoder)))
# (runtime/config_utils.py:146-173: one "key": value per line, numbers above 1e3 as 2.048000e+03)
_ENGINE = re.compile(r"^DeepSpeedEngine configuration:$")
_SETTING = re.compile(r"^  (?P<name>[a-z_][a-z0-9_]*) \.* (?P<value>.*)$")
_USER_JSON = re.compile(r"^  json = (?P<first>\{.*)$")
# deepspeed/utils/timer.py:264-273 (since v0.8.0, 0f0e38c5):
# "epoch={}/micro_step={}/global_step={}, RunningAvgSamplesPerSec={}, CurrSamplesPerSec={}, "
# "MemAllocated={}GB, MaxMemAllocated={}GB"
_TPUT = re.compile(
    r"^epoch=\d+/micro_step=\d+/global_step=(?P<step>\d+), RunningAvgSamplesPerSec=\S+, "
    r"CurrSamplesPerSec=(?P<rate>[-+\w.]+), MemAllocated=[\d.]+GB, "
    r"MaxMemAllocated=(?P<max>[\d.]+)GB$"
)
# the same timer before v0.8.0: "{epoch}/{local_step}, RunningAvgSamplesPerSec=..." (not read)
_TPUT_OLD = re.compile(r"^\d+/\d+, RunningAvgSamplesPerSec=")
# deepspeed/runtime/engine.py:1860-1867: "********** distributed groups summary **********\n"
# f"\t {self.dp_world_size=}\n" ... f"\t {self.sequence_parallel_size=}\n"
_GROUPS = re.compile(
    r"^\t self\.(?P<name>dp_world_size|mp_world_size|sequence_parallel_size)=(?P<value>\d+)$"
)
# deepspeed/runtime/pipe/engine.py:104 (PipelineEngine): f"CONFIG: micro_batches={...} "
_PIPELINE = re.compile(r"^CONFIG: micro_batches=\d+ ")
# transformers configuration_utils.py PreTrainedConfig.from_dict: logger.info(f"Model config
# {config}"); __repr__: f"{self.__class__.__name__} {self.to_json_string()}" (json.dumps(
# to_diff_dict(), indent=2, sort_keys=True)): the keys equal to PreTrainedConfig's defaults left out
_MODEL = re.compile(r"^Model config (?P<cls>\w+) (?P<first>\{.*)$")
# transformers training_args.py TrainingArguments.__str__: attrs_as_str = [f"{k}={v},\n" for k, v
# in sorted(asdict(self).items())]; f"{self.__class__.__name__}(\n{''.join(attrs_as_str)})"
_ARGS_OPEN = re.compile(r"(?:^|\s)(?P<cls>\w*(?:Arguments|Config))\($")
_ARGS_FIELD = re.compile(r"^(?P<name>\w+)=(?P<value>.*),$")


def _message(rest: str) -> str:
    """A line's message: DeepSpeed's, Hugging Face's and the [Rank N] prefixes removed."""
    rest = _HF_PREFIX.sub("", _DS_PREFIX.sub("", rest, count=1), count=1)
    return _DIST.sub("", rest, count=1)


def recognises(text: str) -> bool:
    """Whether ``text`` is a DeepSpeed log: it has the engine's configuration dump or its
    ThroughputTimer line."""
    return bool(
        re.search(
            r"DeepSpeedEngine configuration:|RunningAvgSamplesPerSec=.*CurrSamplesPerSec=", text
        )
    )


@dataclass
class _Start:
    """One engine's ThroughputTimer lines in one writer's lines."""

    lines: list[tuple[int, float, float]] = field(default_factory=list)
    # (global_step, CurrSamplesPerSec, MaxMemAllocated GiB)


def _scan(lines: list[Line], found: Settings, notes: list[str]) -> list[_Start]:
    """Read one writer's lines into ``found``; return its engine starts with their lines."""
    starts: list[_Start] = []
    old_format = 0
    in_dump = False  # between "DeepSpeedEngine configuration:" and its "  json = " line
    i = 0
    while i < len(lines):
        line = lines[i]
        text = line.text
        if m := _TPUT.match(text):
            step = int(m["step"])
            if not starts or (starts[-1].lines and step < starts[-1].lines[-1][0]):
                starts.append(_Start())  # no engine dump before it, or the counter went back
            try:
                rate = float(m["rate"])
            except ValueError:
                rate = float("nan")
            starts[-1].lines.append((step, rate, float(m["max"])))
        elif _ENGINE.match(text):
            starts.append(_Start())
            in_dump = True
        elif in_dump and (m := _SETTING.match(text)):
            found.put(f"engine.{m['name']}", m["value"].strip(), line.no)
        elif m := _USER_JSON.match(text):
            in_dump = False
            config, i = json_block(lines, i, m["first"])
            if isinstance(config, dict):
                found.put("user_config", config, line.no)
            else:
                notes.append(f"line {line.no}: the engine's json config is cut off; not read")
        elif m := _GROUPS.match(text):
            found.put(f"groups.{m['name']}", int(m["value"]), line.no)
        elif m := _MODEL.match(text):
            config, i = json_block(lines, i, m["first"])
            if isinstance(config, dict):
                found.put("model_config", (m["cls"], config), line.no)
            else:
                notes.append(f"line {line.no}: the model config is cut off; not read")
        elif m := _ARGS_OPEN.search(text):
            fields: dict[str, str] = {}
            j = i + 1
            while j < len(lines) and (f := _ARGS_FIELD.match(lines[j].text)):
                fields[f["name"]] = f["value"]
                j += 1
            if "per_device_train_batch_size" in fields:  # a TrainingArguments (subclass) dump
                found.put("trainer_args", fields, line.no)
            i = j - 1 if fields else i
        elif _PIPELINE.match(text):
            found.put("pipeline_engine", text, line.no)
        elif _TPUT_OLD.match(text):
            old_format += 1
        i += 1
    if old_format:
        notes.append(
            f"{old_format} ThroughputTimer line(s) in DeepSpeed's format before v0.8.0 skipped "
            "(their rate is not per optimizer step)"
        )
    return starts


# --- settings ----------------------------------------------------------------------------------


def _whole(where: str, name: str, raw: Any) -> int:
    """A positive whole number from a dump value or a JSON number (DeepSpeed's encoder writes
    numbers above 1e3 as floats: 2.048000e+03)."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise PlannerError(f"{where}: {name}={raw!r}: not a number") from None
    if not value.is_integer() or value <= 0:
        raise PlannerError(f"{where}: {name}={raw!r}: must be a positive whole number")
    return int(value)


def _user(found: Settings, *keys: str) -> Any:
    """The user's json config at ``keys`` (None where absent)."""
    value: Any = found.get("user_config")
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _setting(found: Settings, where: str, name: str, json_key: str, default: int | None) -> int:
    """An engine setting from its dump line, else the user's json, else ``default`` (a
    one-line refusal when there is none)."""
    raw = found.get(f"engine.{name}")
    if raw is None:
        raw = _user(found, json_key)
    if raw is None:
        if default is None:
            raise PlannerError(
                f"{where}: DeepSpeed log states no {name} (no 'DeepSpeedEngine configuration' dump)"
            )
        return default
    return _whole(where, name, raw)


def _enabled(raw: str | None) -> bool | None:
    """A dump line's precision switch: ``True``/``False`` (``bfloat16_enabled``,
    ``fp16_enabled`` before 2025-06) or a config's ``enabled=True ...`` (after)."""
    if raw is None:
        return None
    m = re.match(r"^(?:enabled=)?(True|False)\b", raw)
    return None if m is None else m[1] == "True"


def _precision(found: Settings, where: str) -> str:
    """The run's compute precision, "bf16" or "fp16" (an FP32 run is refused)."""
    bf16 = _enabled(found.get("engine.bfloat16_config") or found.get("engine.bfloat16_enabled"))
    fp16 = _enabled(found.get("engine.float16_config") or found.get("engine.fp16_enabled"))
    if bf16 is None:
        section = _user(found, "bf16") or _user(found, "bfloat16")
        bf16 = bool(isinstance(section, dict) and section.get("enabled"))
    if fp16 is None:
        section = _user(found, "fp16")
        fp16 = bool(isinstance(section, dict) and section.get("enabled"))
    if bf16:
        return "bf16"
    if fp16:
        return "fp16"
    raise PlannerError(
        f"{where}: DeepSpeed runs in FP32 (neither bf16 nor fp16 enabled); the planner prices "
        "BF16 or FP8 compute"
    )


def _offload(found: Settings, where: str, part: str, defaults: list[str]) -> bool:
    """Whether ``zero_optimization.<part>`` puts it on the host (cpu); nvme is refused. An
    unstated one is DeepSpeed's default (none), added to ``defaults``."""
    section = _user(found, "zero_optimization", part)
    device: Any = None
    if isinstance(section, dict):
        device = section.get("device", "none")
    elif found.get("user_config") is not None:
        defaults.append(f"zero_optimization.{part} none")
    else:
        # the zero_config dump line (runtime/zero/config.py, pydantic's str), e.g.
        # "offload_optimizer=DeepSpeedZeroOffloadOptimizerConfig(device=<OffloadDeviceEnum.cpu:
        # 'cpu'>, ..." or "offload_optimizer=None"
        dump = found.get("engine.zero_config") or ""
        m = re.search(rf"{part}=\w+\(device=(?:<\w+\.(\w+): '\w+'>|'(\w+)')", dump)
        if m:
            device = m[1] or m[2]
        elif f"{part}=None" not in dump:
            defaults.append(f"zero_optimization.{part} none")
    if device in (None, "none"):
        return False
    if device == "cpu":
        return True
    raise PlannerError(
        f"{where}: zero_optimization.{part}.device={device!r}: the planner prices offload to "
        "host memory (cpu), not to NVMe"
    )


def _model(found: Settings, where: str, notes: list[str]) -> ModelSpec:
    """The model transformers' ``Model config`` line states (refused without one)."""
    stated = found.get("model_config")
    if stated is None:
        raise PlannerError(
            f"{where}: DeepSpeed log states no model (no transformers 'Model config <Class> {{' "
            "line; DeepSpeed does not log the architecture)"
        )
    cls, config = stated
    config = dict(config)
    if "tie_word_embeddings" not in config:
        # to_diff_dict leaves out keys equal to PreTrainedConfig's defaults (True here)
        config["tie_word_embeddings"] = True
        notes.append(
            "tie_word_embeddings: not in the logged model config, so equal to transformers' "
            "PreTrainedConfig default: True"
        )
    arch = config.get("architectures")
    label = str(arch[0]) if isinstance(arch, list) and arch else cls
    try:
        return load_model({**config, "name": label})
    except PlannerError as exc:
        raise PlannerError(f"{where}: line {found.line('model_config')}: {exc}") from None


def _trainer_args(found: Settings) -> dict[str, str]:
    """The Trainer arguments dump's fields as logged text (empty without a dump)."""
    stated = found.get("trainer_args")
    return {} if stated is None else dict(stated)


def _seq_len(found: Settings, where: str) -> int:
    """The packed sequence length of a TRL SFTConfig dump (see the module docstring)."""
    args = _trainer_args(found)
    key = next((k for k in ("max_length", "max_seq_length") if args.get(k, "None") != "None"), None)
    if key is None:
        raise PlannerError(
            f"{where}: DeepSpeed log states no sequence length (DeepSpeed does not log it; no "
            "Trainer arguments dump with max_length or max_seq_length)"
        )
    if args.get("packing") != "True":
        raise PlannerError(
            f"{where}: {key}={args[key]} without packing=True: samples are cut at that length "
            "and padded per batch, so no fixed sequence length is stated"
        )
    return _whole(where, key, args[key])


def read(text: str, path: str) -> LoggedRun:
    """The run a DeepSpeed log states: its model, job and layout, and the median seconds per
    step over the ThroughputTimer lines after each engine start's warm-up (its first line and
    any line within its first three optimizer steps). Every refusal is one line naming
    ``path``. Assumes one run per file; each engine start (a restart from a checkpoint) is its
    own warm-up."""
    return naming_the_log(path, lambda where: _read(text, path, where))


def _read(text: str, path: str, where: str) -> LoggedRun:
    """The body of ``read``; refusals name the file through ``where``."""
    by_writer, notes = streams(text, _RANK, _message)
    found = Settings(where)
    scanned = {key: _scan(lines, found, notes) for key, lines in by_writer.items()}

    model = _model(found, where, notes)
    seq_len = _seq_len(found, where)
    batch = _setting(found, where, "train_batch_size", "train_batch_size", None)
    micro = _setting(
        found, where, "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu", None
    )
    accumulation = _setting(
        found, where, "gradient_accumulation_steps", "gradient_accumulation_steps", 1
    )
    if batch % (micro * accumulation):
        raise PlannerError(
            f"{where}: train_batch_size={batch} is not train_micro_batch_size_per_gpu={micro} "
            f"x gradient_accumulation_steps={accumulation} x data-parallel ranks"
        )
    dp = batch // (micro * accumulation)
    for name, raw in (
        ("world_size", found.get("engine.world_size")),
        ("dp_world_size", found.get("groups.dp_world_size")),
    ):
        if raw is not None and _whole(where, name, raw) != dp:
            raise PlannerError(
                f"{where}: {name}={raw} but train_batch_size / (micro batch x accumulation) = {dp}"
            )
    if found.get("pipeline_engine") is not None:
        raise PlannerError(
            f"{where}: line {found.line('pipeline_engine')}: DeepSpeed's pipeline engine; the "
            "reader reads data parallelism with ZeRO and Ulysses sequence parallelism only"
        )
    mp = found.get("groups.mp_world_size") or 1
    autotp = _user(found, "tensor_parallel", "autotp_size") or 1
    if mp != 1 or autotp != 1:
        raise PlannerError(
            f"{where}: tensor parallelism (mp_world_size={mp}, autotp_size={autotp}); the reader "
            "reads data parallelism with ZeRO and Ulysses sequence parallelism only"
        )
    defaults: list[str] = []  # settings not stated, taken as DeepSpeed's defaults
    sp = found.get("groups.sequence_parallel_size") or _user(found, "sequence_parallel_size")
    if sp is None:
        sp = 1
        defaults.append("sequence_parallel_size 1")
    sp = _whole(where, "sequence_parallel_size", sp)
    raw_stage = found.get("engine.zero_optimization_stage")
    if raw_stage is None:
        raw_stage = _user(found, "zero_optimization", "stage")
    if raw_stage is None:
        raw_stage = 0
        defaults.append("zero_optimization.stage 0")
    stage_text = "" if isinstance(raw_stage, bool) else str(raw_stage).strip()
    if stage_text not in ("0", "1", "2", "3"):
        raise PlannerError(f"{where}: zero_optimization.stage={raw_stage!r}: must be 0, 1, 2 or 3")
    stage = int(stage_text)
    hpz = _user(found, "zero_optimization", "zero_hpz_partition_size")
    if hpz is None and stage == 3:
        defaults.append("zero_optimization.zero_hpz_partition_size 1")
    precision = _precision(found, where)
    dtypes: dict[str, str] = {"activation_dtype": precision}
    if precision == "fp16":  # FP16 runs keep FP16 weights and gradients
        dtypes.update(weight_dtype="fp16", grad_dtype="fp16")
    grad = _user(found, "data_types", "grad_accum_dtype")
    if grad in ("fp32", "bf16", "fp16"):
        dtypes["grad_dtype"] = str(grad)

    args = _trainer_args(found)
    checkpointing = args.get("gradient_checkpointing")
    if checkpointing is None:
        notes.append("gradient checkpointing: not stated (no Trainer arguments dump); taken as off")
    recompute = "full" if checkpointing == "True" else "none"

    fields: dict[str, Any] = {
        "dp": dp,
        "cp": sp,
        "cp_comm_type": "a2a" if sp > 1 else "p2p",
        "zero": stage,
        "micro_batch": micro,
        "optimizer_offload": 1.0 if _offload(found, where, "offload_optimizer", defaults) else 0.0,
        "param_offload": _offload(found, where, "offload_param", defaults),
        "zero_hpz": _whole(where, "zero_hpz_partition_size", hpz or 1),
    }
    if defaults:
        notes.append("not stated, taken as DeepSpeed's defaults: " + ", ".join(defaults))
    try:
        # The model is Hugging Face's code (its config is what the log states): the registry's
        # Trainer-with-DeepSpeed entry, whose eager norm, MLP and loss hold their own tensors
        job = TrainingJob(seq_len=seq_len, global_batch=batch, framework=HF_DEEPSPEED, **dtypes)
        layout = Layout.uniform(model, recompute=recompute, **fields)
    except PlannerError as exc:
        raise PlannerError(f"{where}: {exc}") from None

    step_s, iterations, allocated = _steady(scanned, batch, where, notes)
    return LoggedRun(
        path=path,
        framework=job.framework,
        model=model,
        job=job,
        layout=layout,
        step_s=step_s,
        iterations=iterations,
        allocated_peak_bytes=allocated,
        reserved_peak_bytes=None,
        notes=tuple(notes),
    )


def _steady(
    scanned: dict[str, list[_Start]], batch: int, where: str, notes: list[str]
) -> tuple[float, int, int | None]:
    """(median seconds per step, how many ThroughputTimer lines it is over, the allocated
    peak in bytes over them) after dropping each engine start's warm-up; per step, the
    slowest writer's time."""
    kept: dict[tuple[int, int], float] = {}
    peak_gib: float | None = None
    dropped: list[str] = []
    for key, starts in scanned.items():
        for ordinal, start in enumerate(s for s in starts if s.lines):
            first = max(start.lines[0][0], WARMUP_STEPS)
            warm = [ln for ln in start.lines if ln[0] <= first]
            who = f" ({key})" if key else ""
            firsts = [ln for ln in start.lines if ln[0] == start.lines[0][0]]
            if len(warm) == len(start.lines) > len(firsts):
                warm = firsts  # a short start: only its first step's line is dropped
                notes.append(
                    f"engine start {ordinal + 1}{who}: every line is within its first "
                    f"{WARMUP_STEPS} steps; kept all but the first"
                )
            dropped.append(
                f"engine start {ordinal + 1}{who}: global_step "
                + ", ".join(str(ln[0]) for ln in warm)
            )
            for step, rate, gib in start.lines[len(warm) :]:
                if not (math.isfinite(rate) and rate > 0):
                    continue
                slot = (ordinal, step)
                kept[slot] = max(kept.get(slot, 0.0), batch / rate)
                peak_gib = gib if peak_gib is None else max(peak_gib, gib)
    if not any(start.lines for starts in scanned.values() for start in starts):
        raise PlannerError(
            f"{where}: DeepSpeed log has no ThroughputTimer line (printed every steps_per_print "
            "steps; unset, DeepSpeed's default since v0.15.2, prints none)"
        )
    if not kept:
        raise PlannerError(
            f"{where}: DeepSpeed log has no steady-state ThroughputTimer lines (each engine "
            f"start's first line and its first {WARMUP_STEPS} steps are warm-up)"
        )
    notes.append("warm-up dropped: " + "; ".join(dropped))
    notes.append(
        "step time: train_batch_size / CurrSamplesPerSec of ThroughputTimer (rank 0), which "
        "times each micro-batch's forward to the optimizer step"
    )
    allocated = None if peak_gib is None else round(peak_gib * GIB)
    return statistics.median(kept.values()), len(kept), allocated
