"""`pipec run --dtype bf16|fp16`: autocast with float32 weights, boundary tensors in the compute dtype.

The runs are tests/runtime/test_runtime_multi.py's (one spawn per rank count, shared): the causal transformer in bf16 on
1, 2 and 4 gloo ranks with 1f1b, zb_h1 and zbv, plus on 2 ranks an fp16 run and a bf16 run of a one-tensor model.
The reference is one process in the same precision: CPU autocast, the same micro-batches, the tensors crossing
the run's stage boundaries cast to the compute dtype as pipec sends them, fp16's loss scaled by 1024.

Tolerance: weights within 1e-5 of that reference (measured: equal to the last bit). pipec runs the same ops on
the same micro-batches in the same dtypes, so what may differ is only the order in which the M micro-batches'
float32 parameter gradients are added (autocast keeps the parameters and their gradients in float32): about
M x 2^-24 of a gradient, 1e-8 of a weight after an SGD step of lr 0.1. In the second step such a last-bit
difference of a weight can flip the rounding of a bf16 activation (8 bits of mantissa: one step is 2^-8 = 0.4%
of the value) and so move some gradient entries by a fraction of a percent; 1e-5 allows for that and stays
8 times below what bf16 itself changes: the same runs differ from float32 training by 8.7e-5 to 1.6e-4
(asserted below to exceed 5e-5, so that a run silently in float32 fails).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_capture import run_main
from test_runtime_multi import MICROBATCHES, MODEL, reference, runs, runs_in, worst_difference

import pipec
from pipec.errors import PipecInputError

BOUND = 1e-5
BF16_EFFECT = 5e-5  # the smallest weight difference bf16 makes against float32 here is 8.7e-5


@pytest.mark.parametrize(("ranks", "name"), runs_in("bf16"))
def test_bf16_trains_like_one_process_in_bf16(ranks: int, name: str) -> None:
    run = runs(ranks)[name, "bf16"]
    partition = tuple(run["report"]["partition"])
    expected, losses = reference(MODEL, "bf16", partition, MICROBATCHES[ranks])
    worst = worst_difference(run["weights"], expected)
    assert worst < BOUND, f"max abs weight difference {worst:g} against one process in bf16"
    assert run["report"]["losses"] == pytest.approx(losses, abs=1e-6)
    fp32, _ = reference(MODEL, "fp32", partition, MICROBATCHES[ranks])
    assert worst_difference(run["weights"], fp32) > BF16_EFFECT  # bf16 really ran
    assert all(value.dtype == torch.float32 for value in run["weights"].values())  # float32 master weights


def test_bf16_boundary_tensors_travel_in_half_the_bytes() -> None:
    """The same model, micro-batches and boundaries at P=2: the activations and their gradients take half the
    bytes in bf16; the int64 positions are unchanged."""
    bf16, fp32 = runs(2)["1f1b", "bf16"]["sent"], runs(2)["zb_h1", "fp32"]["sent"]
    assert {message for message in bf16} == {
        ("SEND_F", (("torch.bfloat16", 128), ("torch.int64", 64))),
        ("SEND_B", (("torch.bfloat16", 128),)),
    }
    assert {message for message in fp32} == {
        ("SEND_F", (("torch.float32", 256), ("torch.int64", 64))),
        ("SEND_B", (("torch.float32", 256),)),
    }
    assert len(bf16) == len(fp32)


def test_fp16_trains_like_one_process_with_the_same_loss_scale() -> None:
    """fp16 (10 bits of mantissa) with its static loss scale of 1024: the same bound, and fp16's own effect on
    the weights (1.3e-5 against float32 here) is above the 2e-6 asserted."""
    run = runs(2)["1f1b", "fp16"]
    partition = tuple(run["report"]["partition"])
    expected, losses = reference(MODEL, "fp16", partition, MICROBATCHES[2])
    assert worst_difference(run["weights"], expected) < BOUND
    assert run["report"]["losses"] == pytest.approx(losses, abs=1e-6)
    fp32, _ = reference(MODEL, "fp32", partition, MICROBATCHES[2])
    assert worst_difference(run["weights"], fp32) > 2e-6
    assert {kind: tensors[0][0] for kind, tensors in run["sent"]} == {
        "SEND_F": "torch.float16",
        "SEND_B": "torch.float16",
    }


def test_bf16_with_one_tensor_between_stages() -> None:
    run = runs(2)["1f1b", "bf16-residual"]
    model = "test_runtime_multi:tiny_residual"
    partition = tuple(run["report"]["partition"])
    expected, _ = reference(model, "bf16", partition, MICROBATCHES[2])
    assert worst_difference(run["weights"], expected) < BOUND
    assert {message[1] for message in run["sent"]} == {(("torch.bfloat16", 96),)}


def test_an_op_the_compute_dtype_cannot_run_is_refused_before_any_worker_starts(tmp_path: Path, monkeypatch) -> None:
    """The dry run before the workers start runs under the --dtype's autocast: a layer that fails there (as an
    op without a kernel for the dtype does) is bad input, exit 2, with the layer and the dtype named."""
    from pipec.runtime.options import Options
    from pipec.runtime.preflight import validate

    (tmp_path / "halfless.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "from pipec.runtime.workload import Workload\n"
        "class NoHalf(nn.Linear):\n"
        "    def forward(self, x):\n"
        "        if torch.is_autocast_enabled('cpu') and torch.get_autocast_dtype('cpu') == torch.float16:\n"
        "            raise RuntimeError('\"addmm_impl_cpu_\" not implemented for \\'Half\\'')\n"
        "        return super().forward(x)\n"
        "def build():\n"
        "    return Workload(nn.Sequential(NoHalf(4, 4), nn.Linear(4, 4)), nn.functional.mse_loss,\n"
        "                    [(torch.randn(4, 4), torch.randn(4, 4))])\n"
    )
    monkeypatch.chdir(tmp_path)
    program = pipec.compile("1f1b", 2, 2)
    with pytest.raises(PipecInputError) as refused:
        validate(program, Options(model="halfless:build", dtype="fp16"))
    assert "layer 0 (NoHalf) fails on a micro-batch of batches[0] (input (2, 4) torch.float32) under --dtype fp16" in (
        refused.value.message
    )
    validate(program, Options(model="halfless:build", dtype="bf16"))  # bf16 is fine
    code, _, err = run_main(["run", "1f1b", "-P", "2", "-M", "2", "--model", "halfless:build", "--dtype", "fp16"])
    assert (
        code == 2 and err.startswith("error: --model halfless:build: layer 0 (NoHalf) fails") and "Traceback" not in err
    )


def test_dtype_flag_takes_the_three_precisions_only() -> None:
    code, _, err = run_main(["run", "1f1b", "-P", "2", "-M", "2", "--model", "x:y", "--dtype", "fp8"])
    assert code == 2 and "argument --dtype: invalid choice: 'fp8'" in err
