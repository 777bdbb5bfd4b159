"""What ``import gockpt`` costs every process a job starts (each rank, each restart): it must not
import ``torch.distributed.tensor`` or ``torch.distributed.checkpoint`` (half a second of CPU
each, there before: 1.4 s against 2.0 s here) -- a process that trains without DTensors or
loads without resharding never uses them; gockpt imports them where they are used."""

import subprocess
import sys

from tests._support import worker_env


def test_importing_gockpt_and_its_deepspeed_patch_leaves_dtensor_and_dcp_unimported():
    code = ("import sys, gockpt, gockpt.integrations.deepspeed\n"
            "heavy = [m for m in ('torch.distributed.tensor', 'torch.distributed.checkpoint')"
            " if m in sys.modules]\n"
            "print(heavy)\n")
    assert _printed(code)[-1] == "[]"


def test_a_cli_command_imports_only_what_it_uses(tmp_path):
    """``gockpt list`` (every command but ``export``) runs without DCP; ``export`` imports it
    with its own module (at its top: the command table names each command's module)."""
    code = ("import sys\nfrom gockpt.cli import main\n"
            f"main(['list', {str(tmp_path)!r}])\n"
            "print('torch.distributed.checkpoint' in sys.modules)\n"
            "import gockpt.cli.export\n"
            "print('torch.distributed.checkpoint' in sys.modules)\n")
    assert _printed(code)[-2:] == ["False", "True"]


def test_the_interval_calculator_starts_without_torch():
    """``gockpt-interval`` is formulas over a few numbers (or a metrics file): it imports
    neither torch nor the rest of gockpt (three seconds before: ``import gockpt`` imported
    the engine, now imported where it is first used)."""
    code = ("import sys\nfrom gockpt.cli.interval import main\n"
            "main(['--mtbf', '3600', '--step-time', '0.5', '--stall', '2'])\n"
            "import gockpt\n"
            "print(sorted(m for m in ('torch', 'numpy', 'gockpt.checkpointer') if m in sys.modules))\n"
            "print(gockpt.core.config.Config.__name__)\n"
            "gockpt.Checkpointer\n"
            "print('gockpt.checkpointer' in sys.modules)\n"
            "print(gockpt.testing.snapshot.__name__, gockpt.storage.tree.__name__)\n")
    # (submodules, however deep, imported when named: reachable as before)
    assert _printed(code)[-4:] == ["[]", "Config", "True", "snapshot gockpt.storage.tree"]


def _printed(code: str) -> list:
    """The lines ``code`` prints in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=worker_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()
