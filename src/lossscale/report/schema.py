"""The telemetry JSONL record schema that ``lossscale report RUN.jsonl`` reads.

One JSON object per line (UTF-8). Blank lines are ignored. A line is a *step record* when it has a
``step`` key, otherwise a *metadata record* (e.g. ``{"meta": {"format": "fp16", "run": "bert-base"}}``),
whose ``meta`` dicts are merged and shown in the report.

Step record keys:

===========================  ==========  ============================================================
key                          type        meaning
===========================  ==========  ============================================================
``step``                     int >= 0    optimizer step index (required)
``loss_scale``               number > 0  the loss scale (required; ``scaler.metrics()`` logs it after
                                         ``update()``: the scale the next step uses; the scale the
                                         sampled gradients carried is ``grad/loss_scale``)
``skipped``                  bool        this step's optimizer update was skipped (inf/NaN gradients).
                                         If absent it is derived from increments of ``skipped_steps``
                                         (counted from 0, this step included), else False.
``skipped_steps``            int         cumulative skipped steps (as ``scaler.metrics()`` reports)
``last_step_skipped``        bool        accepted as ``skipped`` when that is absent
``loss``                     number      the (unscaled) loss
``grad/flushed_frac``        0..1        fraction of all gradient values (``flushed / numel``) that FP16 flushes to 0
                                         at this step's scale (underflow)
``grad/headroom_bits``       number      ``log2(format max / max|g * loss_scale|)``: binades the scaled
                                         gradients can still rise before overflowing. The largest safe
                                         scale of the step is ``loss_scale * 2**headroom_bits``;
                                         negative (or null) on an overflowed step.
``grad/overflow_frac``       0..1        fraction of gradient values that overflow to inf (optional)
``grad/subnormal_frac``      0..1        fraction that land among the subnormals (optional)
``grad/zeros_frac``          0..1        fraction exactly 0 (optional)
``grad/amax``                number      largest finite ``|g * loss_scale|``: the scaled gradients
                                         (optional)
``act/flushed_frac``         0..1        the same as ``grad/flushed_frac`` for the activation gradients
                                         of all watched modules together (optional; may be sampled:
                                         absent or null on the steps between samples)
``act/headroom_bits``        number      the same as ``grad/headroom_bits`` for them (optional)
``<kind>/<layer>/<metric>``  number      optional per-layer figures. ``kind``: ``act`` (activation
                                         gradients, per module, from the backward hooks) or ``param``
                                         (parameter gradients; ``grad/<param>/<metric>`` is read the
                                         same). ``metric``: one of :data:`LAYER_METRICS`. Examples:
                                         ``act/fc1/flushed_frac``, ``param/fc1.weight/headroom_bits``.
===========================  ==========  ============================================================

Other keys are ignored. JSON has no inf/NaN: write ``null``; the strings ``"inf"``, ``"-inf"``, ``"nan"``
and Python's bare ``NaN``/``Infinity``/``-Infinity`` are accepted too. :func:`dumps_record` writes a record the
way this reader wants it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, TextIO, Tuple

__all__ = ["REQUIRED_KEYS", "GLOBAL_METRICS", "LAYER_METRICS", "Telemetry", "parse_records", "read_jsonl",
           "dumps_record", "write_jsonl"]

REQUIRED_KEYS = ("step", "loss_scale")
#: The all-gradient figures, one value per step.
GLOBAL_METRICS = ("grad/flushed_frac", "grad/headroom_bits", "grad/overflow_frac", "grad/subnormal_frac",
                  "grad/zeros_frac", "grad/amax", "act/flushed_frac", "act/headroom_bits", "loss")
#: The metrics a per-layer key may end in.
LAYER_METRICS = ("flushed_frac", "headroom_bits", "overflow_frac", "subnormal_frac")
_KINDS = {"act": "act", "param": "param", "grad": "param"}


@dataclass
class Telemetry:
    """A recorded run as columns (None where a step lacks a figure).

    Attributes:
        step, loss_scale, skipped: one entry per step record, in file order.
        metrics: ``{global key: per-step values}`` for every key of :data:`GLOBAL_METRICS` present.
        layers: ``{(kind, layer, metric): per-step values}`` for every per-layer key present.
        meta: merged ``meta`` of the metadata records.
    """

    step: List[int] = field(default_factory=list)
    loss_scale: List[float] = field(default_factory=list)
    skipped: List[bool] = field(default_factory=list)
    metrics: Dict[str, List[Optional[float]]] = field(default_factory=dict)
    layers: Dict[Tuple[str, str, str], List[Optional[float]]] = field(default_factory=dict)
    meta: Dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.step)

    def layer_series(self, kind: str, metric: str) -> Dict[str, List[Optional[float]]]:
        """``{layer: per-step values}`` of one kind (``act`` or ``param``) and metric."""
        return {layer: vals for (k, layer, m), vals in self.layers.items() if k == kind and m == metric}


_NONFINITE = {"inf": math.inf, "+inf": math.inf, "infinity": math.inf, "-inf": -math.inf, "-infinity": -math.inf,
              "nan": math.nan}


def _number(value: Any, key: str, where: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in _NONFINITE:
        return _NONFINITE[value.strip().lower()]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {key}={value!r} must be a number or null.")
    return float(value)


def _layer_key(key: str) -> Optional[Tuple[str, str, str]]:
    parts = key.split("/")
    if len(parts) < 3 or parts[0] not in _KINDS or parts[-1] not in LAYER_METRICS:
        return None
    return _KINDS[parts[0]], "/".join(parts[1:-1]), parts[-1]


def parse_records(records: Iterable[Mapping[str, Any]], source: str = "<records>") -> Telemetry:
    """Validate step/metadata records (dicts) and return them as :class:`Telemetry` columns."""
    tel = Telemetry()
    prev_skipped_steps = 0
    rows: List[Tuple[Mapping[str, Any], str]] = []
    for i, rec in enumerate(records, 1):
        where = f"{source}:{i}"
        if not isinstance(rec, Mapping):
            raise ValueError(f"{where}: a record must be a JSON object, got {type(rec).__name__}.")
        if "step" not in rec:
            meta = rec.get("meta")
            if isinstance(meta, Mapping):
                tel.meta.update(meta)
            continue
        missing = [k for k in REQUIRED_KEYS if k not in rec]
        if missing:
            raise ValueError(f"{where}: step record is missing {missing} (required: {list(REQUIRED_KEYS)}).")
        step = rec["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{where}: step={step!r} must be an int >= 0.")
        scale = _number(rec["loss_scale"], "loss_scale", where)
        if scale is None or not (scale > 0):
            raise ValueError(f"{where}: loss_scale={rec['loss_scale']!r} must be a number > 0.")
        if "skipped" in rec or "last_step_skipped" in rec:
            skipped = rec["skipped"] if "skipped" in rec else rec["last_step_skipped"]
            if not isinstance(skipped, bool):
                raise ValueError(f"{where}: skipped={skipped!r} must be true or false.")
            if "skipped_steps" in rec and isinstance(rec["skipped_steps"], int):
                prev_skipped_steps = rec["skipped_steps"]
        elif "skipped_steps" in rec:
            count = rec["skipped_steps"]
            if isinstance(count, bool) or not isinstance(count, int):
                raise ValueError(f"{where}: skipped_steps={count!r} must be an int.")
            skipped = count > prev_skipped_steps  # the count includes this step's skip
            prev_skipped_steps = count
        else:
            skipped = False
        tel.step.append(step)
        tel.loss_scale.append(scale)
        tel.skipped.append(bool(skipped))
        rows.append((rec, where))
    n = len(rows)
    for j, (rec, where) in enumerate(rows):
        for key, value in rec.items():
            if key in GLOBAL_METRICS:
                tel.metrics.setdefault(key, [None] * n)[j] = _number(value, key, where)
            else:
                lk = _layer_key(key)
                if lk is not None:
                    tel.layers.setdefault(lk, [None] * n)[j] = _number(value, key, where)
    for key in ("grad/flushed_frac", "grad/overflow_frac", "grad/subnormal_frac"):
        for j, v in enumerate(tel.metrics.get(key, ())):
            if v is not None and math.isfinite(v) and not (0.0 <= v <= 1.0):
                raise ValueError(f"{rows[j][1]}: {key}={v!r} must lie in [0, 1].")
    return tel


def read_jsonl(path: str) -> Telemetry:
    """Read a telemetry JSONL file (see the module docstring for the schema)."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not a JSON object ({e.msg}); one JSON object per line is expected.") from None
    # Line numbers in errors count records, which equal lines unless there are blank lines.
    tel = parse_records(records, source=path)
    if not tel.step:
        raise ValueError(f"{path}: no step records (objects with 'step' and 'loss_scale') found.")
    return tel


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def dumps_record(record: Mapping[str, Any]) -> str:
    """One record as a JSON line (no newline), inf/NaN written as null so any JSON reader accepts it."""
    return json.dumps(_clean(record), allow_nan=False, separators=(",", ":"))


def write_jsonl(fh: TextIO, records: Iterable[Mapping[str, Any]]) -> None:
    """Write records, one JSON line each, to an open text file."""
    for rec in records:
        fh.write(dumps_record(rec) + "\n")
