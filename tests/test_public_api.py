"""The public import surface, and the promise that importing lossscale stays light."""

import subprocess
import sys

import lossscale


def test_public_names_are_exported_and_documented():
    for name in lossscale.__all__:
        obj = getattr(lossscale, name)
        if getattr(obj, "__module__", "").startswith("torch."):
            continue  # torch's own, re-exported as it is (OptState: so the stages compare with torch's)
        assert obj.__doc__, f"lossscale.{name} has no docstring"


def test_public_methods_have_docstrings():
    for name in lossscale.__all__:
        obj = getattr(lossscale, name)
        if isinstance(obj, type):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and callable(member):
                    assert member.__doc__, f"lossscale.{name}.{attr} has no docstring"


def test_import_does_not_pull_matplotlib_or_sklearn():
    # (tqdm is not checked: torch itself imports it, through torch.hub.)
    code = "import sys, lossscale; print(sorted(m for m in ('matplotlib', 'sklearn') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_audit_and_keep_fp32_load_lazily_and_keep_their_names():
    # lossscale.audit is a function; its module is lossscale.auditing, so importing the module (first or
    # later) never replaces the function on the package.
    code = (
        "import sys, lossscale\n"
        "assert not any(m in sys.modules for m in ('lossscale.auditing', 'lossscale.fp32'))\n"
        "import lossscale.auditing, lossscale.fp32\n"
        "assert callable(lossscale.audit) and lossscale.audit is lossscale.auditing.audit\n"
        "assert lossscale.AuditReport is lossscale.auditing.AuditReport\n"
        "assert lossscale.keep_fp32 is lossscale.fp32.keep_fp32\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
