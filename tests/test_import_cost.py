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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=worker_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
