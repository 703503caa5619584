"""mutmut's test map for code that runs in spawned processes (the gloo ranks of the distributed tests).

mutmut 3 runs each mutant's tests inside its ``mutants/`` copy: the mutant is chosen by the
environment variable ``MUTANT_UNDER_TEST`` and imported from ``mutants/src``, which mutmut puts first
on ``sys.path``. A process started by multiprocessing's ``spawn`` inherits both (the environment, and
the parent's ``sys.path`` sent with the spawn), so the ranks run the mutant. What they do not do is
tell mutmut which functions they ran: mutmut first runs every test once with
``MUTANT_UNDER_TEST=stats`` and records, in the pytest process, which mutated functions each test
reached, then runs a mutant only against the tests that reached its function. A rank's records stay in
the rank, so a function only the ranks run (the flags' all-reduce) gets no test, and its mutants are
reported as "no tests" however well the distributed tests check it.

This module closes that gap without touching the tests; ``benchmarks/mutation.sh`` installs it into
mutmut's virtual environment and turns it on with ``LOSSSCALE_MUTMUT_HITS`` (a folder):

* in a process that *starts* with ``MUTANT_UNDER_TEST=stats`` (a spawned rank during the stats run;
  loaded from a ``.pth`` line), every mutated function reached is appended to ``<folder>/<pid>.txt``;
* in the pytest process (loaded as a plugin through ``PYTEST_PLUGINS``), each test's teardown moves
  the names in those files into mutmut's record of that test, just before mutmut reads it.

Only the functions listed under ``spawned_functions`` in ``setup.cfg``'s ``[mutmut]`` section (as
``module.Class.method`` or ``module.function``, or ``module.*`` for every function of a module) are
given the tests that reach them in the ranks: the
ones with code only the ranks run (a reduction across ranks). The ranks run nearly the whole scaler,
and a distributed test costs seconds before its first check (each of its ranks imports torch), so
giving them every function would make each mutant of the policies pay that, for code the
single-process tests already reach. A test whose ranks ran is also charged :data:`SPAWN_COST_S` in
mutmut's record of its duration (the pool's start, paid by whichever test comes first): mutmut runs
a mutant's tests shortest first, so the single-process tests get the first chance to kill it, and the
time limits it derives from the durations leave room for the start.

The mutant runs need nothing from here: the ranks already run the mutant.

This reaches into mutmut's internals, as mutmut 3.8.1 (the version ``mutation.sh`` installs and checks)
has them: ``mutmut.mutation.trampoline.record_trampoline_hit``, ``mutmut.stats.record_trampoline_hit``,
``mutmut.state.state().duration_by_test`` and the mangled names (``xǁClassǁmethod``, ``x_function``). A
newer mutmut may move any of them: bump ``version`` in ``mutation.sh`` only with this file checked.
"""

from __future__ import annotations

import os

_FOLDER = os.environ.get("LOSSSCALE_MUTMUT_HITS")
#: What a test whose ranks ran is charged beyond its own duration: a pool's start, measured at 4 to 6 s
#: on the shared two-core machine.
SPAWN_COST_S = 10.0


def _record_in_this_spawned_process() -> None:
    """Replace mutmut's recorder (this process's record is lost when it exits) by one that writes
    every function reached to this process's file, line-buffered: written by the time the rank
    reports its scenario's result to the test."""
    import mutmut.mutation.trampoline as trampoline

    out = open(os.path.join(_FOLDER, f"{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115 (process-long)
    last = [None]

    def record(name: str, caller=None) -> None:
        if name != last[0]:  # repeats in a row say nothing new
            out.write(name + "\n")
            last[0] = name

    trampoline.record_trampoline_hit = record


def _readable(name: str) -> str:
    """mutmut's name of a function (``pkg.mod.xǁClassǁmethod``, ``pkg.mod.x_function``) as written in
    setup.cfg (``pkg.mod.Class.method``, ``pkg.mod.function``)."""
    module, _, mangled = name.rpartition(".")
    if mangled.startswith("x\u01c1"):
        return f"{module}.{'.'.join(mangled[2:].split(chr(0x1C1)))}"
    return f"{module}.{mangled[2:]}" if mangled.startswith("x_") else name


def _listed() -> set:
    import configparser

    parser = configparser.ConfigParser()
    parser.read("setup.cfg")  # mutmut runs the tests in mutants/, its copy of the project
    return set(parser.get("mutmut", "spawned_functions", fallback="").split())


def _merge_into_this_test(item) -> None:
    """Add the listed functions the spawned processes reached since the last test to mutmut's record of
    the test now tearing down (read, then emptied: the ranks live across tests and keep appending), and
    charge the test a pool's start if they ran at all."""
    from mutmut.state import state
    from mutmut.stats import record_trampoline_hit

    names = set()
    for entry in os.scandir(_FOLDER):
        with open(entry.path, "r+") as f:
            names |= set(f.read().split())
            f.truncate(0)
    if not names:
        return
    state().duration_by_test[item.nodeid] = state().duration_by_test.get(item.nodeid, 0.0) + SPAWN_COST_S
    listed = _listed()
    whole = tuple(entry[:-1] for entry in listed if entry.endswith(".*"))  # "module.*": all its functions
    for name in names:
        readable = _readable(name)
        if readable in listed or readable.startswith(whole):
            record_trampoline_hit(name)


if _FOLDER and os.environ.get("MUTANT_UNDER_TEST") == "stats":
    _record_in_this_spawned_process()

if _FOLDER:
    try:
        import pytest
    except ImportError:  # a spawned rank imports this before its sys.path reaches the project's packages
        pass
    else:

        @pytest.hookimpl(tryfirst=True)  # before mutmut's own teardown hook reads its record
        def pytest_runtest_teardown(item, nextitem):
            if os.environ.get("MUTANT_UNDER_TEST") == "stats":
                _merge_into_this_test(item)
