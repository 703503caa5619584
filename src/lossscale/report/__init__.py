"""The reports: headless plots (:mod:`.plots`), the HTML writer (:mod:`.html`), the telemetry JSONL
schema and reader (:mod:`.schema`) and ``lossscale report`` (:mod:`.run_report`).

matplotlib is imported only when a plot is drawn, so importing this package stays light.
"""

from .schema import Telemetry, dumps_record, parse_records, read_jsonl, write_jsonl

__all__ = ["Telemetry", "dumps_record", "parse_records", "read_jsonl", "write_jsonl"]
