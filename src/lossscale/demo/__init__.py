"""``lossscale demo``: the seed's claims about FP16 loss scaling, measured on sklearn's digits.

* :mod:`.workload` — data, the MLP, the training loop with the controlled loss shift ``c``.
* :mod:`.observe` — per-step figures from lossscale's telemetry, stats and hooks.
* :mod:`.claims` — one function per claim, returning the figures and the checks that decide it.
* :mod:`.run` — the runs, the orchestration and the progress bars; :func:`run_demo`.
* :mod:`.render` — plots, ``index.html``, ``summary.json`` and the terminal table.

``lossscale audit-demo`` is :mod:`.fp32_fallback` (a forward overflow no scale fixes) and
:mod:`.backward_overflow` (a backward that overflows FP16 at any scale >= 1; its model is also the one
``benchmarks/bench_backward_overflow.py`` measures).

Needs the demo extras (scikit-learn, matplotlib, tqdm); importing this package does not import them.
"""

__all__ = ["run_demo", "DemoConfig"]


def __getattr__(name):
    if name in __all__:
        from . import run

        return getattr(run, name)
    raise AttributeError(name)
