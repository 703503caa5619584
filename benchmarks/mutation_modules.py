"""The modules ``benchmarks/mutation.sh`` can mutate one at a time, beyond the policy core.

    python benchmarks/mutation_modules.py SETUP_CFG MODULE...   # rewrites SETUP_CFG's [mutmut] section
    python benchmarks/mutation_modules.py --list                # the names, their files and tests

``mutation.sh REV MODULE...`` calls it on the copy of setup.cfg in its work folder (never the
checkout's): ``only_mutate`` becomes the named modules' files, the test selection their tests,
``spawned_functions`` gains the functions only spawned ranks run (``module.*``: every function of the
module, read by ``benchmarks/mutmut_spawned.py``). Without a module, mutation.sh runs setup.cfg as
committed: the policy core (the recorded score).

Each module's tests are the files that drive it, kept small: mutmut runs the whole selection twice
before the first mutant (a clean run and the run that maps tests to functions), and a distributed or
framework test costs seconds before its first check (its ranks import torch). ``env`` names the
virtual environment the tests need when it is not the project's (activate it before mutation.sh).
"""

from __future__ import annotations

import configparser
import sys
from dataclasses import dataclass
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class Module:
    sources: Tuple[str, ...]
    tests: Tuple[str, ...]
    spawned: Tuple[str, ...] = ()
    env: str = ""  # "": the project's virtual environment


DIST = ("tests/test_distributed.py", "tests/test_sharded.py")

MODULES: Dict[str, Module] = {
    "scaler": Module(
        ("src/lossscale/scaler.py",),
        (
            "tests/test_scaler.py",
            "tests/test_scaler_vs_torch.py",
            "tests/test_check.py",
            "tests/test_clip.py",
            "tests/test_checkpoint.py",
            "tests/test_first_cause.py",
            "tests/test_bad_input.py",
            "tests/test_on_step.py",
            "tests/test_schedulers.py",
            "tests/test_syncs.py",
            "tests/test_stuck.py",
            "tests/test_torch_compat.py",
            "tests/test_skip_matrix.py",
        ),
    ),
    "check": Module(
        ("src/lossscale/_check.py",),
        ("tests/test_check.py", "tests/test_clip.py", "tests/test_scaler.py", "tests/test_syncs.py", *DIST),
        spawned=(
            "lossscale._check.GradientCheck.group",
            "lossscale._check.GradientCheck.flags",
            "lossscale._check.GradientCheck.nan_pass",
            "lossscale._check.GradientCheck.gather",
            "lossscale._check.clip_scaled_",
        ),
    ),
    "spikes": Module(("src/lossscale/spikes.py",), ("tests/test_spikes.py",)),
    # Without the distributed telemetry test: given every telemetry function (the ranks reach them all),
    # each surviving mutant paid a pool's start, and a run had done 86 of 289 mutants after 19 minutes.
    # The reduction across ranks (metrics_with's group branch) is left to tests/test_distributed.py.
    "telemetry": Module(
        ("src/lossscale/telemetry.py",),
        (
            "tests/test_telemetry.py",
            "tests/test_syncs.py::test_telemetry_adds_no_sync",
            "tests/test_bad_input.py",
            "tests/test_checkpoint.py",
            "tests/test_report.py",
            "tests/test_integrations_loggers.py",
            "tests/test_health.py",
        ),
    ),
    # The same file against the distributed tests that run telemetry in their ranks (FSDP2 shards, a rank
    # of empty shards): for a rerun of the survivors above (MUTATION_ONLY=), each paying a pool's start.
    "telemetry-ranks": Module(
        ("src/lossscale/telemetry.py",),
        (
            "tests/test_telemetry.py",
            "tests/test_distributed.py::test_fsdp2_local_shard_inf_and_random_injections",
            "tests/test_distributed.py::test_telemetry_with_a_rank_holding_only_empty_shards",
        ),
        spawned=("lossscale.telemetry.*",),
    ),
    "trace": Module(("src/lossscale/trace.py",), ("tests/test_trace.py", "tests/test_first_cause.py")),
    "upcast": Module(("src/lossscale/upcast.py",), ("tests/test_upcast.py", "tests/test_backward_upcast.py")),
    "microbatches": Module(
        ("src/lossscale/microbatches.py",), ("tests/test_microbatches.py", "tests/test_microbatch_weights.py")
    ),
    "distributed": Module(("src/lossscale/distributed.py",), DIST, spawned=("lossscale.distributed.*",)),
    "torchtitan": Module(
        ("src/lossscale/integrations/torchtitan.py",),
        ("tests/test_rl_torchtitan.py",),
        spawned=("lossscale.integrations.torchtitan.*",),
        env="envs/torchtitan/ci.sh's venv",
    ),
    "verl": Module(
        ("src/lossscale/integrations/verl.py",),
        ("tests/test_rl_verl.py",),
        spawned=("lossscale.integrations.verl.*",),
        env="envs/verl/ci.sh's venv",
    ),
}


def _lines(values) -> str:
    return "\n" + "\n".join(values)


def rewrite(path: str, names: List[str]) -> None:
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        raise SystemExit(f"mutation_modules: no module named {', '.join(unknown)}; known: {', '.join(MODULES)}")
    chosen = [MODULES[n] for n in names]
    parser = configparser.RawConfigParser()  # no interpolation: the patterns hold backslashes and %
    parser.read(path)
    section = parser["mutmut"]
    section["only_mutate"] = _lines(s for m in chosen for s in m.sources)
    section["pytest_add_cli_args_test_selection"] = _lines(dict.fromkeys(t for m in chosen for t in m.tests))
    spawned = section.get("spawned_functions", "").split()
    section["spawned_functions"] = _lines(dict.fromkeys(spawned + [f for m in chosen for f in m.spawned]))
    if any(m.env for m in chosen):  # the frameworks' venvs have no hypothesis: its seed option is unknown there
        args = [a for a in section["pytest_add_cli_args"].split() if not a.startswith("--hypothesis")]
        section["pytest_add_cli_args"] = _lines(args)
    with open(path, "w") as f:
        parser.write(f)


def main(argv: List[str]) -> None:
    if argv[:1] == ["--list"]:
        for name, m in MODULES.items():
            env = f"  [env: {m.env}]" if m.env else ""
            print(f"{name}: {' '.join(m.sources)} <- {' '.join(m.tests)}{env}")
        return
    if len(argv) < 2:
        raise SystemExit(__doc__)
    rewrite(argv[0], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
