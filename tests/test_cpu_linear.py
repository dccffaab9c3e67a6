"""CPU matmul kernel selection: kernels agree with F.linear, the tuner keeps the fastest per
shape and row count (fake kernels on a fake clock), plans round-trip and are cached."""
import json

import pytest
import torch
import torch.nn.functional as F

from engine.models.cpu_linear import (
    KERNELS,
    LinearPlan,
    ShapePlan,
    available_kernels,
    load_or_tune,
    plan_key,
    tune,
)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_every_available_kernel_matches_f_linear(dtype, tol):
    torch.manual_seed(0)
    w, b = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    names = available_kernels(dtype)
    assert "aten" in names
    for name in names:
        for rows in (1, 2, 3, 5, 9, 33):
            x = torch.randn(rows, 64, dtype=dtype)
            with torch.inference_mode():
                for bias in (None, b):
                    got = KERNELS[name](x, w, bias)
                    want = F.linear(x, w, bias)
                    assert got.shape == want.shape == (rows, 96) and got.is_contiguous()
                    torch.testing.assert_close(got.float(), want.float(), atol=tol * 8, rtol=tol)


class _FakeClock:
    """Advances by what the fake kernel that just ran says it cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_tuner_keeps_the_fastest_kernel_per_shape_and_row_count():
    clock = _FakeClock()

    def fake(cost):  # cost(rows, out_features) -> seconds
        def k(x, w, b):
            clock.now += cost(x.shape[0], w.shape[0])
            return x.new_zeros(x.shape[0], w.shape[0])
        return k

    kernels = {
        "aten": fake(lambda m, o: 1.0),  # flat
        "onednn": fake(lambda m, o: 0.2 * m),  # cheap for few rows
        "mkl_nt": fake(lambda m, o: 0.5 if o > 10 else 2.0),  # good only for the tall weight
    }
    weights = [torch.zeros(8, 4), torch.zeros(16, 4), torch.zeros(8, 4)]
    plan = tune(weights, rows=(1, 2, 4, 8), candidates=list(kernels), passes=1, kernels=kernels, clock=clock)
    assert plan.counts == {(8, 4): 2, (16, 4): 1}
    # 8x4: onednn while 0.2 m < 1, then aten; 16x4: onednn at 1 and 2 rows, then mkl_nt.
    assert plan.shapes[(8, 4)].kernels == ("onednn", "onednn", "onednn", "aten")
    assert plan.shapes[(16, 4)].kernels == ("onednn", "onednn", "mkl_nt", "mkl_nt")
    assert plan.shapes[(16, 4)].ms == pytest.approx((200.0, 400.0, 500.0, 500.0))
    # A forward at 4 rows: two 8x4 weights (0.8 s each) and the 16x4 one (0.5 s).
    assert plan.gemm_ms(4) == pytest.approx(2 * 800 + 500)
    assert plan.gemm_ms(3) == pytest.approx(2 * 600 + 450)  # linear between measured counts
    assert plan.kernel_name((8, 4), 3) == "onednn"  # between counts: the next larger one's kernel
    assert plan.kernel_name((8, 4), 1000) == "aten"  # past the last: the last one's
    assert plan.kernel((99, 4), 1) is KERNELS["aten"]  # a shape not in the plan: torch's default
    assert "1-4:onednn 5-8:aten" in plan.describe()


def test_tuner_rejects_kernel_names_a_plan_cannot_hold():
    with pytest.raises(ValueError, match="unknown kernels"):
        tune([torch.zeros(4, 4)], rows=(1,), candidates=["mine"], kernels={"mine": KERNELS["aten"]})


def test_plan_json_round_trip_and_version_check():
    plan = LinearPlan({(8, 4): ShapePlan((1, 4), ("mkl_nt", "onednn"), (0.5, 0.7))}, {(8, 4): 3})
    back = LinearPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert back.shapes == plan.shapes and back.counts == plan.counts
    bad = plan.to_json() | {"version": 0}
    with pytest.raises(ValueError, match="version"):
        LinearPlan.from_json(bad)


def test_load_or_tune_caches_per_machine_and_shapes(tmp_path):
    weights = [torch.randn(24, 16), torch.randn(40, 16)]
    plan = load_or_tune(weights, tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert [f.name for f in files] == [f"{plan_key(weights)}.json"]
    stamp = files[0].stat().st_mtime_ns
    again = load_or_tune(weights, tmp_path)  # read back, not re-measured
    assert again.shapes == plan.shapes and files[0].stat().st_mtime_ns == stamp
    assert plan_key([torch.randn(24, 16)]) != plan_key(weights)
    files[0].write_text("{torn")  # a damaged cache file is measured again, not trusted
    assert load_or_tune(weights, tmp_path).counts == plan.counts


def test_a_model_with_a_plan_computes_the_same_logits(tiny_llama_dir):
    from engine.models.loader import load_model

    model = load_model(str(tiny_llama_dir), torch.float32, "cpu").model
    weights = model.matmul_weights()
    assert len(weights) == 4 * model.cfg.num_layers + 1
    plan = tune(weights, rows=(1, 2, 4, 8), passes=1)
    hidden = torch.randn(5, model.cfg.hidden_size)
    with torch.inference_mode():
        want = model.compute_logits(hidden)
        model.set_linear_plan(plan)
        got = model.compute_logits(hidden)
        mlp_in = torch.randn(3, model.cfg.hidden_size)
        mlp = model.layers[0].mlp
        with_plan = mlp(mlp_in)
        model.set_linear_plan(None)
        without = mlp(mlp_in)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(with_plan, without, atol=1e-4, rtol=1e-4)
