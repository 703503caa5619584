"""The telemetry JSONL record schema that ``lossscale report RUN.jsonl`` reads.

One JSON object per line (UTF-8). Blank lines are ignored. A line is a *step record* when it has a
``step`` key, otherwise a *metadata record* (e.g. ``{"meta": {"format": "fp16", "run": "bert-base"}}``),
whose ``meta`` dicts are merged and shown in the report.

Step record keys:

===========================  ==========  ============================================================
key                          type        meaning
===========================  ==========  ============================================================
``step``                     int >= 0    optimizer step index (required; below 2**63, as are the counters)
``loss_scale``               number > 0  the loss scale (required; ``scaler.metrics()`` logs it after
                                         ``update()``: the scale the next step uses; the scale the
                                         sampled gradients carried is ``grad/loss_scale``). A broken
                                         scale is read as it was logged: ``"nan"`` (what
                                         ``JsonlLogger`` writes) and ``null`` as NaN, ``"inf"`` as inf
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
                                         gradients, per module: what
                                         ``ActivationGradRecorder.metrics()`` and
                                         ``lossscale.hooks.activation_metrics`` return) or ``param``
                                         (parameter gradients; ``grad/<param>/<metric>``, as
                                         ``scaler.metrics()`` logs them with ``per=``, is read the
                                         same and keeps its name in the report). ``metric``: one of
                                         :data:`LAYER_METRICS`. Examples: ``act/fc1/flushed_frac``,
                                         ``grad/fc1.weight/headroom_bits``.
===========================  ==========  ============================================================

A run logged every N steps is fine: the report counts the steps from the step numbers, and the skips
between records from the cumulative ``skipped_steps``.

Other keys are ignored. JSON has no inf/NaN: write ``null``; the strings ``"inf"``, ``"-inf"``, ``"nan"``
and Python's bare ``NaN``/``Infinity``/``-Infinity`` are accepted too. :func:`dumps_record` writes a record the
way this reader wants it.

Bad lines: :func:`read_jsonl` skips a line that is not a JSON object (e.g. the truncated last line a killed
run leaves) or not a valid record (the whole record is skipped), counts it in :attr:`Telemetry.bad_lines`
and warns once per file; ``strict=True`` raises instead. :func:`parse_records` raises by default.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, TextIO, Tuple

__all__ = [
    "REQUIRED_KEYS",
    "GLOBAL_METRICS",
    "LAYER_METRICS",
    "Telemetry",
    "parse_records",
    "read_jsonl",
    "dumps_record",
    "write_jsonl",
]

REQUIRED_KEYS = ("step", "loss_scale")
#: The all-gradient figures, one value per step.
GLOBAL_METRICS = (
    "grad/flushed_frac",
    "grad/headroom_bits",
    "grad/overflow_frac",
    "grad/subnormal_frac",
    "grad/zeros_frac",
    "grad/amax",
    "act/flushed_frac",
    "act/headroom_bits",
    "loss",
)
#: The metrics a per-layer key may end in.
LAYER_METRICS = ("flushed_frac", "headroom_bits", "overflow_frac", "subnormal_frac")
_KINDS = {"act": "act", "param": "param", "grad": "param"}


@dataclass
class Telemetry:
    """A recorded run as columns (None where a step lacks a figure).

    Attributes:
        step: each step record's step, in file order.
        loss_scale: each step record's loss scale, in file order.
        skipped: whether each step record's step was skipped, in file order.
        skipped_steps: the record's cumulative ``skipped_steps`` counter, None where it has none.
        metrics: ``{global key: per-step values}`` for every key of :data:`GLOBAL_METRICS` present.
        layers: ``{(kind, layer, metric): per-step values}`` for every per-layer key present.
        layer_keys: ``{(kind, layer, metric): the key as logged}``: ``grad/0/flushed_frac`` is read as
            kind ``param`` and keeps its own name here (see :meth:`layer_key`).
        meta: merged ``meta`` of the metadata records.
        bad_lines: ``(line or record number, reason)`` of every line or record that was skipped.
    """

    step: List[int] = field(default_factory=list)
    loss_scale: List[float] = field(default_factory=list)
    skipped: List[bool] = field(default_factory=list)
    skipped_steps: List[Optional[int]] = field(default_factory=list)
    metrics: Dict[str, List[Optional[float]]] = field(default_factory=dict)
    layers: Dict[Tuple[str, str, str], List[Optional[float]]] = field(default_factory=dict)
    layer_keys: Dict[Tuple[str, str, str], str] = field(default_factory=dict)
    meta: Dict[str, Any] = field(default_factory=dict)
    bad_lines: List[Tuple[int, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.step)

    def layer_series(self, kind: str, metric: str) -> Dict[str, List[Optional[float]]]:
        """``{layer: per-step values}`` of one kind (``act`` or ``param``) and metric."""
        return {layer: vals for (k, layer, m), vals in self.layers.items() if k == kind and m == metric}

    def layer_key(self, kind: str, layer: str, metric: str) -> str:
        """The JSONL key a per-layer series was logged under (``grad/fc1.weight/flushed_frac`` for kind
        ``param``), for legends and tables that name what the file holds."""
        return self.layer_keys.get((kind, layer, metric), f"{kind}/{layer}/{metric}")


_NONFINITE = {
    "inf": math.inf,
    "+inf": math.inf,
    "infinity": math.inf,
    "-inf": -math.inf,
    "-infinity": -math.inf,
    "nan": math.nan,
}


_INT_BOUND = 2**63  # step and skipped_steps: what an int64 (numpy, torch, the plots' arrays) holds


def _number(value: Any, key: str, where: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in _NONFINITE:
        return _NONFINITE[value.strip().lower()]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {key}={value!r} must be a number or null.")
    try:
        return float(value)
    except OverflowError:  # an int beyond the largest float (JSON integers have no bound)
        raise ValueError(
            f"{where}: {key}={_short(value)} is too large for a float (the largest is about 1.8e308)."
        ) from None


def _count(value: Any, key: str, where: str) -> int:
    """An integer field (``step``, ``skipped_steps``): an int in [0, 2**63)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _INT_BOUND:
        raise ValueError(f"{where}: {key}={_short(value)} must be an int >= 0 and < 2**63.")
    return value


def _short(value: Any) -> str:
    """``repr(value)``, an int of more than 20 digits as its size (a 400-digit number is no help in an
    error message)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20:
        # from the bit length: str() of an int over 4300 digits raises (sys.get_int_max_str_digits)
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return repr(value)


def _text_error(rec: Mapping[str, Any], where: str) -> Optional[str]:
    """The first key or string value (nested ``meta`` included) that is not text: JSON can spell a lone
    UTF-16 surrogate (``"\\ud800"``), which no UTF-8 file, plot label or HTML page can hold."""
    for key, value in rec.items():
        for text, what in ((key, "key"), (value, f"value of {key!r}")):
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    return f"{where}: the {what} ({text!r}) holds a lone surrogate, which is not text."
        if isinstance(value, Mapping):
            nested = _text_error(value, where)
            if nested is not None:
                return nested
    return None


def _layer_key(key: str) -> Optional[Tuple[str, str, str]]:
    parts = key.split("/")
    if len(parts) < 3 or parts[0] not in _KINDS or parts[-1] not in LAYER_METRICS:
        return None
    return _KINDS[parts[0]], "/".join(parts[1:-1]), parts[-1]


def _parse_step(rec: Mapping[str, Any], where: str, prev_skipped_steps: int):
    """Validate one step record; return ``(step, scale, skipped, skipped_steps, count, values, logged)``
    or raise ValueError.

    ``count`` is the record's own ``skipped_steps`` counter (None if absent). ``values`` maps every
    global metric and per-layer key of the record to its number, so a record is accepted or refused
    whole; ``logged`` maps each per-layer target to the key it was logged under.
    """
    missing = [k for k in REQUIRED_KEYS if k not in rec]
    if missing:
        raise ValueError(f"{where}: step record is missing {missing} (required: {list(REQUIRED_KEYS)}).")
    step = _count(rec["step"], "step", where)
    scale = _number(rec["loss_scale"], "loss_scale", where)
    if scale is None:
        scale = math.nan  # null: how strict JSON writers (dumps_record) store a NaN scale
    if not (scale > 0 or math.isnan(scale)):
        raise ValueError(f"{where}: loss_scale={rec['loss_scale']!r} must be a number > 0 (or NaN/inf as logged).")
    if "skipped" in rec or "last_step_skipped" in rec:
        skipped = rec["skipped"] if "skipped" in rec else rec["last_step_skipped"]
        if not isinstance(skipped, bool):
            raise ValueError(f"{where}: skipped={skipped!r} must be true or false.")
        if "skipped_steps" in rec and isinstance(rec["skipped_steps"], int):
            prev_skipped_steps = _count(rec["skipped_steps"], "skipped_steps", where)
    elif "skipped_steps" in rec:
        count = _count(rec["skipped_steps"], "skipped_steps", where)
        skipped = count > prev_skipped_steps  # the count includes this step's skip
        prev_skipped_steps = count
    else:
        skipped = False
    values: Dict[Any, Optional[float]] = {}
    logged: Dict[Tuple[str, str, str], str] = {}
    for key, value in rec.items():
        target = key if key in GLOBAL_METRICS else _layer_key(key)
        if target is not None:
            values[target] = _number(value, key, where)
            if isinstance(target, tuple):
                logged[target] = key
    for key in ("grad/flushed_frac", "grad/overflow_frac", "grad/subnormal_frac"):
        v = values.get(key)
        if v is not None and math.isfinite(v) and not (0.0 <= v <= 1.0):
            raise ValueError(f"{where}: {key}={v!r} must lie in [0, 1].")
    count = rec.get("skipped_steps")
    count = count if isinstance(count, int) and not isinstance(count, bool) else None
    return step, scale, bool(skipped), prev_skipped_steps, count, values, logged


@dataclass(frozen=True)
class _Unparsable:
    """A line that is not JSON, kept in its place so that errors come in file order."""

    reason: str


def _parse(numbered: Iterable[Tuple[int, Any]], source: str, skip_bad: bool, tel: Telemetry) -> Telemetry:
    prev_skipped_steps = 0
    rows: List[Dict[Any, Optional[float]]] = []
    for i, rec in numbered:
        where = f"{source}:{i}"
        try:
            if isinstance(rec, _Unparsable):
                raise ValueError(f"{where}: {rec.reason}")
            if not isinstance(rec, Mapping):
                raise ValueError(f"{where}: a record must be a JSON object, got {type(rec).__name__}.")
            not_text = _text_error(rec, where)
            if not_text is not None:
                raise ValueError(not_text)
            if "step" not in rec:
                meta = rec.get("meta")
                if isinstance(meta, Mapping):
                    tel.meta.update(meta)
                continue
            step, scale, skipped, prev_skipped_steps, count, values, logged = _parse_step(
                rec, where, prev_skipped_steps
            )
        except ValueError as e:
            if not skip_bad:
                raise
            tel.bad_lines.append((i, str(e)[len(where) + 2 :]))
            continue
        tel.step.append(step)
        tel.loss_scale.append(scale)
        tel.skipped.append(skipped)
        tel.skipped_steps.append(count)
        tel.layer_keys.update(logged)
        rows.append(values)
    n = len(rows)
    for j, values in enumerate(rows):
        for key, v in values.items():
            column = tel.metrics if isinstance(key, str) else tel.layers
            column.setdefault(key, [None] * n)[j] = v
    return tel


def parse_records(
    records: Iterable[Mapping[str, Any]], source: str = "<records>", *, skip_bad: bool = False
) -> Telemetry:
    """Validate step/metadata records (dicts) and return them as :class:`Telemetry` columns.

    A bad record raises ValueError naming its position and key; with ``skip_bad=True`` it is left
    out and listed in :attr:`Telemetry.bad_lines` instead.
    """
    return _parse(enumerate(records, 1), source, skip_bad, Telemetry())


def read_jsonl(path: str, *, strict: bool = False) -> Telemetry:
    """Read a telemetry JSONL file (see the module docstring for the schema).

    Lines that are not JSON objects or not valid records are skipped, listed in
    :attr:`Telemetry.bad_lines` (with their line numbers) and reported in one warning: a run that
    was killed leaves a truncated last line, and one bad line should not cost the whole report.
    ``strict=True`` raises ValueError at the first bad line instead.  A file without a single valid
    step record raises ValueError.
    """
    records: List[Tuple[int, Any]] = []
    with open(path, "rb") as fh:  # bytes: one line that is not UTF-8 is one bad line, not a failed report
        for i, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                records.append((i, json.loads(raw.decode("utf-8"))))
            except UnicodeDecodeError:
                records.append((i, _Unparsable("not UTF-8 text; one JSON object per line is expected.")))
            except json.JSONDecodeError as e:
                records.append((i, _Unparsable(f"not a JSON object ({e.msg}); one JSON object per line is expected.")))
            except ValueError as e:  # an integer of more digits than Python reads (sys.get_int_max_str_digits)
                records.append((i, _Unparsable(f"not readable as JSON ({str(e).split(';')[0]}).")))
            except RecursionError:  # the json module recurses once per nesting level
                records.append(
                    (i, _Unparsable("nested too deeply to read; one flat JSON object per line is expected."))
                )
    tel = _parse(records, path, not strict, Telemetry())
    if not tel.step:
        skipped = (
            f" ({len(tel.bad_lines)} bad lines skipped, first: line {tel.bad_lines[0][0]}: {tel.bad_lines[0][1]})"
            if tel.bad_lines
            else ""
        )
        raise ValueError(f"{path}: no step records (objects with 'step' and 'loss_scale') found{skipped}.")
    if tel.bad_lines:
        first = "; ".join(f"line {i}: {why}" for i, why in tel.bad_lines[:3])
        more = f"; and {len(tel.bad_lines) - 3} more" if len(tel.bad_lines) > 3 else ""
        warnings.warn(f"{path}: skipped {len(tel.bad_lines)} bad line(s) ({first}{more})", stacklevel=2)
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
