"""Expert and expert-tensor parallelism under torchrun on the CPU (gloo).

A full Megatron MoE layer with TorchGroupedMLP experts gives the outputs and input gradients of the
same layer with SequentialMLP experts and of a one-process FP64 reference holding every expert;
distributed checkpoints load both ways across layouts; invalid shapes fail with one message on
every rank. Each layout is one torchrun launch of a worker in tests/distributed/ (several checks
inside it), under a hard timeout, so a hang fails instead of blocking CI; the tests below read the
JSON each rank writes. scripts/gpu_distributed.sh runs the same workers on GPUs (NCCL).
"""

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.torchrun import ROOT
from support.torchrun import torchrun as launch_torchrun

pytestmark = pytest.mark.distributed

WORKERS = ROOT / "tests" / "distributed"
TIMEOUT_S = 240
REFERENCE_TOL = 2e-2  # bf16 layer vs FP64 reference of the same bf16 weights and inputs
SEQUENTIAL_TOL = 1e-3  # same math, same eager ops on the CPU (GPUs: 2e-2, fused activation)

ETP_ERRORS = {
    "ffn_not_divisible_by_etp/config":
        "moe_ffn_hidden_size=33: it must be divisible by expert_tensor_parallel_size=2.",
    "ffn_not_divisible_by_etp/experts":
        "moe_ffn_hidden_size=33: it must be divisible by expert_tensor_parallel_size=2.",
    "ffn_shard_misaligned/layer":
        "moe_ffn_hidden_size=24: the per-rank width 24/2=12 must be a multiple of 8",
}
EP_ERRORS = {
    "experts_not_divisible_by_ep/config":
        "num_moe_experts=5: it must be divisible by expert_model_parallel_size=2.",
    "experts_not_divisible_by_ep/experts":
        "num_moe_experts=5: it must be divisible by expert_model_parallel_size=2.",
}
# name: (processes, worker arguments, the validation errors this layout must raise)
LAYOUTS = {
    "ep2": (2, ["--ep", "2"], EP_ERRORS),
    "etp2": (2, ["--etp", "2"], ETP_ERRORS),
    "ep2_etp2": (4, ["--ep", "2", "--etp", "2"], {**ETP_ERRORS, **EP_ERRORS}),
    "tp2_sp_ep2": (2, ["--tp", "2", "--sp", "--ep", "2"], EP_ERRORS),
}


@dataclass
class Launch:
    returncode: int
    output: str
    ranks: list  # the JSON each rank wrote, by rank
    nproc: int

    def results(self) -> list:
        """Every rank's result; fails with the launch's output if a rank wrote none."""
        if len(self.ranks) != self.nproc:
            pytest.fail(f"{len(self.ranks)} of {self.nproc} ranks reported (exit status "
                        f"{self.returncode}):\n{self.output[-8000:]}")
        return self.ranks


def torchrun(worker: str, nproc: int, args: list, out: Path) -> Launch:
    """One launch of a worker of tests/distributed/ on `nproc` CPU processes (torchrun_support),
    each rank writing `out/rank{R}.json`."""
    run = launch_torchrun(WORKERS / worker, nproc, ["--out", str(out), *args],
                          out / "torchrun.log", TIMEOUT_S)
    ranks = [json.loads((out / f"rank{r}.json").read_text())
             for r in range(nproc) if (out / f"rank{r}.json").exists()]
    return Launch(run.returncode, run.output, ranks, nproc)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, tmp_path_factory):
    nproc, args, _ = LAYOUTS[request.param]
    launch = torchrun("moe_parity.py", nproc, args, tmp_path_factory.mktemp(request.param))
    return request.param, launch


def test_every_rank_finishes_cleanly(layout):
    name, launch = layout
    launch.results()
    assert launch.returncode == 0, launch.output[-8000:]


def test_moe_layer_matches_sequential_mlp_and_fp64_reference(layout):
    """Output and input gradient of the whole layer (router included), on every rank."""
    name, launch = layout
    for rank in launch.results():
        assert {(row["dispatcher"], row["case"]) for row in rank["parity"]} >= {
            ("allgather", "swiglu"), ("allgather", "squared_relu")}
        for row in rank["parity"]:
            where = f"{name} rank {rank['rank']} {row['dispatcher']}/{row['case']}: {row}"
            assert row["out_vs_sequential"] <= SEQUENTIAL_TOL, where
            assert row["grad_vs_sequential"] <= SEQUENTIAL_TOL, where
            assert row["out_vs_reference"] <= REFERENCE_TOL, where
            assert row["grad_vs_reference"] <= REFERENCE_TOL, where


def test_experts_receive_exactly_the_tokens_routed_to_them(layout):
    """tokens_per_expert seen by the local experts = the reference routing of every token of the
    ranks the dispatcher gathers from; the experts hold their shard, untouched, with no grad."""
    name, launch = layout
    for rank in launch.results():
        for row in rank["parity"]:
            assert row["tokens_per_expert"] == row["expected_tokens_per_expert"], (name, row)
            assert row["sequential_tokens_per_expert"] == row["expected_tokens_per_expert"]
            assert row["experts_untouched"], (name, rank["rank"], row)


def test_fp32_combine_layer_reads_the_gathered_tokens_in_place(layout):
    """TorchGroupedMLP in the FP32CombineMoELayer: on the allgather dispatcher its experts get
    the tokens gathered from every rank and the row index (RoutedTokens), on alltoall the
    permuted rows; output and input gradient against the FP64 reference; the tokens routed to
    them."""
    name, launch = layout
    for rank in launch.results():
        for row in rank["parity"]:
            where = f"{name} rank {rank['rank']} {row['dispatcher']}/{row['case']}: {row}"
            handed = "RoutedTokens" if row["dispatcher"] == "allgather" else "Tensor"
            assert row["fp32_combine_experts_input"] == handed, where
            assert row["fp32_combine_out_vs_reference"] <= REFERENCE_TOL, where
            assert row["fp32_combine_grad_vs_reference"] <= REFERENCE_TOL, where
            assert row["fp32_combine_tokens_per_expert"] == row["expected_tokens_per_expert"]


def test_invalid_shapes_fail_with_one_message_on_every_rank(layout):
    name, launch = layout
    expected = LAYOUTS[name][2]
    ranks = launch.results()
    assert all(rank["errors"] == ranks[0]["errors"] for rank in ranks), [r["errors"] for r in ranks]
    assert set(ranks[0]["errors"]) == set(expected)
    for case, fragment in expected.items():
        message = ranks[0]["errors"][case]
        assert message is not None, f"{case} was built without an error"
        assert message.startswith("TorchExpertsConfigError: ") and fragment in message, message


def test_alltoall_dispatcher(layout):
    name, launch = layout
    ranks = launch.results()
    skipped = [s for s in ranks[0]["skipped"] if s["dispatcher"] == "alltoall"]
    if skipped:
        pytest.skip(skipped[0]["reason"])
    assert any(row["dispatcher"] == "alltoall" for rank in ranks for row in rank["parity"])


# TEGroupedMLP needs Transformer Engine on CUDA, and these launches run on the CPU: NCCL cannot
# put two ranks on one GPU, so the TEGroupedMLP rows are made only by scripts/gpu_distributed.sh
# (--device cuda, two GPUs or more). There the workers fail the launch on a row out of their
# bounds (moe_parity.py: TOLERANCE["te"] and ["reference"]; checkpoint_roundtrip.py: a missing
# or unexpected key, a weight not equal). Here every rank states that it skipped them, and why.


def assert_te_rows_skipped(ranks, rows: str):
    """Every rank reports TEGroupedMLP's `rows` skipped, for this host's reason (no TE, or TE but
    a CPU launch), and has none of them."""
    if importlib.util.find_spec("transformer_engine") is None:
        reason = "Transformer Engine is not importable"
    else:
        reason = "TEGroupedMLP runs on CUDA only and this launch is --device cpu"
    reasons = {rank["te_skipped"] for rank in ranks}
    assert len(reasons) == 1 and next(iter(reasons)).startswith(reason), reasons
    assert all(rank[rows] == [] for rank in ranks)


def test_cpu_launch_reports_the_te_grouped_mlp_parity_skipped(layout):
    _, launch = layout
    assert_te_rows_skipped(launch.results(), "te_parity")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return torchrun("checkpoint_roundtrip.py", 2, [], tmp_path_factory.mktemp("checkpoints"))


def test_checkpoints_load_both_ways_across_layouts(checkpoints):
    """SequentialMLP@EP2 -> TorchGroupedMLP@{EP2, ETP2, EP1} and TorchGroupedMLP -> SequentialMLP:
    no missing or unexpected key, every loaded weight equal to its global shard."""
    ranks = checkpoints.results()
    assert checkpoints.returncode == 0, checkpoints.output[-8000:]
    for rank in ranks:
        trips = {(row["source"], row["target"]) for row in rank["round_trips"]}
        assert {("sequential@ep2", "torch@ep2"), ("sequential@ep2", "torch@etp2"),
                ("sequential@ep2", "torch@ep1"), ("torch@etp2", "sequential@ep2")} <= trips
        assert {row["glu"] for row in rank["round_trips"]} == {True, False}
        for row in rank["round_trips"]:
            where = f"rank {rank['rank']} {row['source']} -> {row['target']} glu={row['glu']}"
            assert row["missing"] == [] and row["unexpected"] == [], where
            assert row["weights_equal"], where
            if row["target"].startswith("torch@"):
                assert row["packed_views"], f"{where}: weights no longer view the packed buffer"


def test_cpu_launch_reports_the_te_grouped_mlp_checkpoint_chains_skipped(checkpoints):
    assert_te_rows_skipped(checkpoints.results(), "te_round_trips")


@pytest.fixture(scope="module", params=["shared", "per_expert"])
def adapters_after_reused_buffer(request, tmp_path_factory):
    pytest.importorskip("triton", reason="triton is not installed: the fused kernels are untested")
    launch = torchrun("adapters_after_reused_buffer.py", 2,
                      ["--ep", "2", "--adapter", request.param],
                      tmp_path_factory.mktemp(f"reused_buffer_{request.param}"))
    return request.param, launch


def test_adapters_train_from_their_own_tokens_after_the_next_gather(adapters_after_reused_buffer):
    """LoRA on the experts (shared and per expert) in two FP32CombineMoELayers on the allgather
    dispatcher at EP=2, fused kernels (the worker runs them under the Triton interpreter): the
    experts read Megatron's global all-gather buffer in place, and the second layer's gather
    rewrites it before the first layer's backward. Backward runs (gloo used to refuse it: the
    shared fc1 adapter had saved the buffer for A's gradient), and the output, the input gradient
    and every adapter factor's gradient of both layers match the FP64 reference on every rank."""
    adapter, launch = adapters_after_reused_buffer
    assert launch.returncode == 0, launch.output[-8000:]
    for rank in launch.results():
        assert rank["experts_input"] == ["RoutedTokens", "RoutedTokens"], rank
        worst = max(rank["errors"].values())
        assert worst <= rank["tolerance"], (adapter, rank["rank"], rank["errors"])
        assert len(rank["errors"]) == 2 + 2 * 2 * 2  # out, grad_x; 2 layers x 2 linears x A, B


# adapter layout: its extra torchrun arguments (TP=2 with sequence parallelism: each TP rank feeds
# its own sequence shard, and the shared adapter's gradient is summed over TP as well).
EXPERT_ADAPTER_LAYOUTS = {"shared": [], "per_expert": [], "shared_tp2_sp": ["--tp", "2", "--sp"]}


@pytest.fixture(scope="module", params=[
    pytest.param(layout, marks=[pytest.mark.once_per_venv] if "tp2" in layout else [])
    for layout in EXPERT_ADAPTER_LAYOUTS])
def expert_adapters_ep2(request, tmp_path_factory):
    adapter = request.param.split("_tp")[0]
    launch = torchrun("expert_adapters_ep.py", 2, ["--ep", "2", "--adapter", adapter,
                                                   *EXPERT_ADAPTER_LAYOUTS[request.param]],
                      tmp_path_factory.mktemp(f"expert_adapters_ep2_{request.param}"))
    assert launch.returncode == 0, launch.output[-8000:]
    return adapter, launch.results()


def test_expert_adapters_train_on_every_ranks_tokens_under_ddp_at_ep2(expert_adapters_ep2):
    """LoRA on TorchGroupedMLP at EP=2 under Megatron's DistributedDataParallel, each rank its own
    tokens, one SGD step: a shared adapter (one for all of the layer's experts) is reduced over
    the data-parallel group that spans EP (allreduce True): its gradient and update are the FP64
    full-batch ones over the DP size, bitwise the same on both ranks. A per-expert adapter stays
    expert-parallel (allreduce False): the full-batch gradient of its rank's experts. At TP=2
    with sequence parallelism, Megatron's finalize_model_grads also sums the shared adapter over
    TP (sequence_parallel True); without that sum each rank would hold half the gradient."""
    adapter, ranks = expert_adapters_ep2
    for rank in ranks:
        where = f"{adapter} rank {rank['rank']}"
        assert set(rank["allreduce"].values()) == {adapter == "shared"}, (where, rank["allreduce"])
        assert set(rank["sequence_parallel"].values()) == {rank["tp"] > 1}, where
        for errors in ("grad_errors", "step_errors"):
            assert len(rank[errors]) == 4, where
            assert max(rank[errors].values()) <= rank["tolerance"], (where, rank[errors])
        if adapter == "shared":
            assert all(rank["identical_after_step"].values()), (where, rank["identical_after_step"])
    if adapter == "per_expert":
        assert [r["local_experts"] for r in ranks] == [[0, 1], [2, 3]]


def test_expert_adapters_dist_checkpoint_round_trip_at_ep2(expert_adapters_ep2):
    """lora_state_dict keeps every adapter weight on every rank; lora_sharded_state_dict saves a
    shared adapter once (one main replica in the world) and loads it on both EP ranks, a
    per-expert adapter as one [E_global, ...] tensor of which each rank holds its experts; a
    fresh model with other adapter values reloads every adapter weight bit for bit."""
    adapter, ranks = expert_adapters_ep2
    keys = sorted(f"mlp.experts.{linear}.adapter.linear_{io}.weight"
                  for linear in ("linear_fc1", "linear_fc2") for io in ("in", "out"))
    for rank in ranks:
        where = f"{adapter} rank {rank['rank']}"
        assert rank["lora_state_dict_keys"] == keys and rank["sharded_keys"] == keys, where
        for key in keys:
            local, global_ = rank["lora_state_dict_shapes"][key], rank["global_shapes"][key]
            if adapter == "shared":
                assert global_ == local and len(local) == 2, (where, key, local, global_)
                assert rank["main_replicas"][key] == 1, (where, key, rank["main_replicas"])
            else:
                assert local[0] == 2 and global_ == [4, *local[1:]], (where, key, global_)
                assert rank["main_replicas"][key] == 2, (where, key)  # one per EP shard
        assert rank["fresh_differed"], where
        assert rank["round_trip_equal"], where
        # shared: the same weights on both EP ranks; per expert: each rank its own experts'
        assert set(rank["reloaded_identical"].values()) == {adapter == "shared"}, where


@pytest.fixture(scope="module", params=["ep2", "etp2"])
def batch_invariance_launch(request, tmp_path_factory):
    pytest.importorskip("megatron.core.transformer.moe.batch_invariant",
                        reason="batch-invariant MoE is megatron-core 0.20's (this leg is older)")
    args = {"ep2": ["--ep", "2"], "etp2": ["--ep", "1", "--etp", "2"]}[request.param]
    return torchrun("batch_invariance_ep.py", 2, args,
                    tmp_path_factory.mktemp(f"batch_invariance_{request.param}"))


def test_in_batch_invariant_mode_each_ranks_probe_tokens_are_bitwise_the_same_in_any_batch(
        batch_invariance_launch):
    """megatron-core 0.20's batch_invariant_mode at EP=2, and at ETP=2 (each rank half of every
    expert, the rows of both gathered in uneven sizes and the partial outputs reduce-scattered
    back): alltoall dispatcher, its fixed-order unpermute by EP rank then top-k slot, our experts
    with no adapter, a shared and a per-expert LoRA (at EP=2; ours need ETP=1), Megatron's
    combine. Each rank's probe tokens alone, among 7x others and among 32x others piled onto two
    experts, the other rank's tokens changing too; outputs and input gradients bit for bit. Under
    gloo the uneven all-gather gets the test side's padded stand-in
    (support.cpu_support.uneven_all_gather)."""
    launch = batch_invariance_launch
    ranks = launch.results()
    assert launch.returncode == 0, launch.output[-8000:]
    for rank in ranks:
        # our expert adapters need expert_tensor_parallel_size=1: the experts alone at ETP=2
        adapters = {"None"} if "etp" in rank["layout"] else {"None", "shared", "per_expert"}
        assert set(rank["differences"]) == adapters, rank
        for adapter, by_context in rank["differences"].items():
            control = by_context.pop("control")
            assert len(by_context) == 3, by_context
            assert all(diff == [0.0, 0.0] for diff in by_context.values()), (
                rank["rank"], adapter, by_context)
            assert min(control) > 0, ("a changed probe value went unseen", adapter, control)
