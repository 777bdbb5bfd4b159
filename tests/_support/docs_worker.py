"""The DeepSpeed example of docs/deepspeed.md run as written, in a rank process of its own
(started by tests/test_docs_examples.py through tests/_support/dist_ranks.py: DeepSpeed sets
up torch.distributed, which the test process itself must not). The names the example assumes
are those of a DeepSpeed script: ``deepspeed``, ``torch``, a small model, its ``ds_config``
(bf16, AdamW, ZeRO 1), a ``loader`` of 30 batches and ``save_dir``.

    python -m tests._support.docs_worker DIRECTORY SCENARIO    SCENARIO: JSON {"page", "index"}

Prints ``rank 0: ok`` when the example ran, its checkpoints verify, and its
``load_checkpoint`` returned the last one with its ``client_state``.
"""

import json
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
if os.environ.get("GOCKPT_TEST_CPUINFO"):  # (as tests/_support/deepspeed_worker.py)
    import cpuinfo
    _CPU_INFO = json.loads(os.environ["GOCKPT_TEST_CPUINFO"])
    cpuinfo.get_cpu_info = lambda: dict(_CPU_INFO)


def names() -> dict:
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    loader = [(torch.randn(4, 16, generator=g).bfloat16(), torch.randn(4, 4, generator=g))
              for _ in range(30)]
    ds_config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                 "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9}
    return {"deepspeed": deepspeed, "torch": torch, "model": model, "ds_config": ds_config,
            "loader": loader, "save_dir": "checkpoints/ds_run"}


def main():
    import gockpt
    from tests.test_docs_examples import blocks
    directory, sc = sys.argv[1], json.loads(sys.argv[2])
    code = blocks()[(sc["page"], sc["index"])]
    os.chdir(directory)
    ns = names()
    exec(compile(code, f"{sc['page']}:example {sc['index']}", "exec"), ns)
    gockpt.integrations.deepspeed.wait(ns["engine"])
    assert ns["client_state"] == {"data_pos": 30}, ns["client_state"]
    assert ns["engine"].global_steps == 30
    assert os.path.realpath(ns["load_path"]).startswith(os.path.realpath("checkpoints/ds_run"))
    assert gockpt.storage.list_checkpoints("checkpoints/ds_run") == [
        f"step-{s:09d}" for s in (10, 20, 30)], gockpt.storage.list_checkpoints("checkpoints/ds_run")
    assert gockpt.verify("checkpoints/ds_run").ok
    print("rank 0: ok", flush=True)


if __name__ == "__main__":
    main()
