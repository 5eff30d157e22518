"""Block sizes of the fused expert kernels (fused_experts_triton.py) against what they replace.

At each shape (shapes.py) and routing of bench_experts.py: fc1 + activation x probs (grouped_mm,
then the fused activation kernel) against `fc1_activation` with each candidate tiling, and fc2's
input gradient + the activation's backward (grouped_mm, then the activation backward kernel)
against `fc2_dgrad_activation`. CUDA events, median of --reps after warm-ups. Writes tiles.md.

    python benchmarks/fused_tiles_sweep.py --out-dir runs/tiles
"""

import argparse
from pathlib import Path

import torch

from harness import REPO_ROOT, fmt, markdown_table, median_ms
from harness import header as bench_header
from shapes import SHAPES, make_splits

CANDIDATES = {  # Tiles(block_m, block_n, block_k, warps, stages)
    "fc1": [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3),
            (128, 256, 32, 8, 5)],
    "fc1_glu": [(128, 128, 64, 8, 3), (128, 64, 64, 8, 4), (128, 128, 32, 8, 5)],
    "dgrad": [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)],
    "dgrad_glu": [(128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 3),
                  (128, 64, 64, 8, 3)],
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "runs" / "tiles")
    parser.add_argument("--shapes", default="super-ep4,qwen3-30b,nano")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    from megatron.core.activations import squared_relu

    from mcore_torch_experts import find_grouped_mm
    from mcore_torch_experts.kernels import activation_triton as act_kernels
    from mcore_torch_experts.kernels import fused_experts_triton as fused
    from mcore_torch_experts.kernels.choice import KERNEL_ACTIVATIONS

    device = torch.device("cuda", 0)
    gmm = find_grouped_mm().fn
    rows_out = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        act = KERNEL_ACTIVATIONS[squared_relu if shape.activation == "squared_relu"
                                 else torch.nn.functional.silu]
        width = shape.ffn * (2 if shape.glu else 1)
        w1 = (torch.randn(shape.experts, width, shape.hidden, device=device) * 0.02).bfloat16()
        w2 = (torch.randn(shape.experts, shape.hidden, shape.ffn, device=device) * 0.02).bfloat16()
        for routing in ("uniform", "skewed"):
            splits = make_splits(shape.rows, shape.experts, routing, 1.0, 1234)
            offs = splits.cumsum(0).to(device=device, dtype=torch.int32)
            x = torch.randn(shape.rows, shape.hidden, device=device).bfloat16()
            gy = torch.randn(shape.rows, shape.hidden, device=device).bfloat16()
            probs = torch.rand(shape.rows, device=device)
            h = gmm(x, w1.transpose(1, 2), offs=offs)

            def time(fn):
                return median_ms(fn, device, 3, args.reps)[0]

            base_fc1 = time(lambda: act_kernels._forward(gmm(x, w1.transpose(1, 2), offs=offs),
                                                         probs, act, shape.glu, 0.0))
            grad_act = gmm(gy, w2, offs=offs)

            def base_dgrad():
                g = gmm(gy, w2, offs=offs)
                dh = torch.empty_like(h)
                act_kernels._backward_kernel[act_kernels._grid(h.shape[0], g.shape[1])](
                    g, h, probs, dh, h.shape[0], g.shape[1], g.stride(0), h.stride(0), 0.0,
                    ACT=act, GLU=shape.glu, BLOCK_R=act_kernels.BLOCK_ROWS,
                    BLOCK_C=act_kernels.BLOCK_COLS)
                return dh

            base_bwd = time(base_dgrad)
            ref_out = act_kernels._forward(h, probs, act, shape.glu, 0.0)
            ref_dh = base_dgrad()
            del grad_act
            kind = "fc1_glu" if shape.glu else "fc1"
            for tiles in CANDIDATES[kind]:
                setattr(fused, "FC1_GLU_TILES" if shape.glu else "FC1_TILES", fused.Tiles(*tiles))
                run = lambda: fused.fc1_activation(x, w1, offs, probs, act, shape.glu, 0.0,  # noqa
                                                   None, save_h=True)
                out, h_f = run()
                err = float((out.float() - ref_out.float()).norm() / ref_out.float().norm())
                ms = time(run)
                rows_out.append([name, routing, kind, str(tiles), fmt(base_fc1), fmt(ms),
                                 fmt(base_fc1 / ms, ".3f"), f"{err:.1e}"])
                print("[tiles]", rows_out[-1], flush=True)
            for tiles in CANDIDATES["dgrad_glu" if shape.glu else "dgrad"]:
                setattr(fused, "DGRAD_GLU_TILES" if shape.glu else "DGRAD_TILES",
                        fused.Tiles(*tiles))
                run = lambda: fused.fc2_dgrad_activation(gy, w2, offs, probs, h, act,  # noqa
                                                         shape.glu, 0.0, None, False)
                dh, _ = run()
                err = float((dh.float() - ref_dh.float()).norm() / ref_dh.float().norm())
                ms = time(run)
                rows_out.append([name, routing, "dgrad_glu" if shape.glu else "dgrad", str(tiles),
                                 fmt(base_bwd), fmt(ms), fmt(base_bwd / ms, ".3f"), f"{err:.1e}"])
                print("[tiles]", rows_out[-1], flush=True)
    lines = ["# Fused expert kernel tilings", ""] + [f"- {h}" for h in bench_header(device)] + [""]
    lines += markdown_table(["shape", "routing", "kernel", "tiles (m, n, k, warps, stages)",
                             "grouped_mm + activation kernel ms", "fused ms",
                             "speed-up", "rel diff"], rows_out)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "tiles.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
