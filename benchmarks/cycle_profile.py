"""The RL cycle's update pass by component: profiler ranges from forward hooks, the
classification of every profiled op's GPU time, the breakdown table and the stacked-bar plot.

Forward ops (and the recompute's) take the innermost `bench::<component>` range open around
them, or the innermost range the package's fused GEMM path opens (enums.ProfileRange: expert
GEMMs, expert adapters); a backward op takes the package range opened inside its autograd node's
backward, else the component of the forward op that made the node (sequence numbers); ops the
re-entrant checkpoint's backward runs outside a nested backward node are the recompute; gradient
accumulation into a leaf goes to the adapters (the only trainable leaves). `GPU idle` is the
measured update time minus the profiled device time.

The MoE side (`moe_side`): the components from the router to the combine, MOE_SIDE (router,
permute/dispatch, expert GEMMs, expert activation, expert adapters, combine/unpermute, and the
MoE layer's own ops outside those, `MoE layer, rest`), forward and backward, plus the same
components' part of the recompute forward (the recompute's ops are split by the innermost
`bench::` range open around them: the forward hooks fire again when the checkpoint re-runs the
layer). Not in it: the shared expert, the latent projections, attention, norms, the head, the
optimizer, gradient accumulation into the adapter leaves (`adapters`: AccumulateGrad nodes are
not tied to a module) and `other`. Its denominator, the expert-GEMM kernel time, is the device
time of the GEMM kernels (GEMM_KERNEL, by name) that ran for the expert GEMMs component or under
its range in the recompute; on the CPU the own CPU time of the matmul ops there. `other` can hold
MoE work whose op lost its range (kernels launched outside any recorded op, a backward node
whose forward op was not recorded): `moe_bound_ms` adds all of `other` (and the recompute's
`other`) to the MoE side, an upper bound, and `other_gemm_ms` is the GEMM kernels in `other`.
"""

import collections
import re
import statistics
import time

from harness import markdown_table, pyplot, save_figure, sync
from mcore_torch_experts.enums import ExpertKernel, ProfileRange

ATTENTION, ROUTER, LATENT, DISPATCH = ("attention", "router", "latent projections",
                                       "permute/dispatch")
GEMMS, ACTIVATION, SHARED, COMBINE = ("expert GEMMs", "expert activation", "shared expert",
                                      "combine/unpermute")
ADAPTERS, RECOMPUTE, OPTIMIZER = "adapters", "recompute (forward)", "optimizer"
EXPERT_ADAPTERS, MOE_REST = "expert adapters", "MoE layer, rest"
HEAD, NORMS, OTHER, IDLE = ("embedding, output layer, loss", "norms, residuals", "other",
                            "GPU idle")
COMPONENTS = [ATTENTION, ROUTER, LATENT, DISPATCH, GEMMS, ACTIVATION, SHARED, COMBINE,
              EXPERT_ADAPTERS, MOE_REST, ADAPTERS, RECOMPUTE, OPTIMIZER, HEAD, NORMS, OTHER, IDLE]
MOE_SIDE = (ROUTER, DISPATCH, GEMMS, ACTIVATION, EXPERT_ADAPTERS, COMBINE, MOE_REST)
# GEMM kernels by name: cuBLAS (nvjet, xmma, gemm), CUTLASS (TE's and torch's grouped GEMMs); on
# the CPU the matmul ops. Not the grouped GEMM's argument preparation.
GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|^aten::(_grouped_mm|mm|bmm|addmm|baddbmm)$",
                         re.IGNORECASE)
NOT_GEMM_KERNEL = re.compile(r"prepare_grouped_gemm", re.IGNORECASE)
RANGE = "bench::"
EVALUATE = "autograd::engine::evaluate_function: "
DISPATCH_METHODS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess")
COMBINE_METHODS = ("combine_preprocess", "token_combine", "combine_postprocess")
PACKAGE_RANGES = {ProfileRange.EXPERT_GEMMS.value: GEMMS,
                  ProfileRange.EXPERT_ADAPTERS.value: EXPERT_ADAPTERS}
TOP_KERNELS = 4  # expert GEMM kernel names kept per arm (which GEMM library ran)
UNCLAIMED = "(device time of no profiled op)"


def is_adapter_wrapper(module) -> bool:
    """Our LoRALinear and Megatron-Bridge's AdapterWrapper both hold `to_wrap` and `adapter`."""
    return hasattr(module, "to_wrap") and hasattr(module, "adapter")


def runs_fused_gemm(experts) -> bool:
    """Whether `experts` pick the package's fused GEMM kernels, which call the expert linears'
    packed weights and adapters' factors directly: a hook on those modules would turn the path
    off (a forced "fused_gemm" raises, "auto" runs grouped_mm), so the ranges leave them to the
    package's own (PACKAGE_RANGES)."""
    kernels = getattr(experts, "kernels", None)
    return getattr(kernels, "expert_kernel", None) == ExpertKernel.FUSED_GEMM


def expert_kernels(model) -> list:
    """The expert kernels the model's experts ran in their latest forward ("fused_gemm",
    "grouped_mm"; sorted, each once; empty for experts that do not say)."""
    return sorted({str(m.last_expert_kernel) for m in model.modules()
                   if getattr(m, "last_expert_kernel", None) is not None})


def component_ranges(model):
    """(module -> component) for the forward hooks, and (dispatcher, method, component) for the
    token dispatchers' phases, for GPTModel and HybridModel. Experts on the fused GEMM path keep
    their linears and adapters unhooked (runs_fused_gemm)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    modules, methods = {model: HEAD, model.decoder: OTHER}, []
    fused = tuple(f"{name}." for name, module in model.named_modules() if runs_fused_gemm(module))
    for name, module in model.named_modules():
        if isinstance(module, TransformerLayer):
            modules[module] = NORMS
            modules[module.self_attention] = ATTENTION
        elif isinstance(module, MoELayer):
            modules[module] = MOE_REST
            modules[module.router] = ROUTER
            modules[module.experts] = ACTIVATION
            for part, component in (("shared_experts", SHARED), ("fc1_latent_proj", LATENT),
                                    ("fc2_latent_proj", LATENT)):
                if getattr(module, part, None) is not None:
                    modules[getattr(module, part)] = component
            methods += [(module.token_dispatcher, m, DISPATCH) for m in DISPATCH_METHODS]
            methods += [(module.token_dispatcher, m, COMBINE) for m in COMBINE_METHODS]
        elif is_adapter_wrapper(module) and not any(name.startswith(f) for f in fused):
            modules[module.adapter] = ADAPTERS
            if ".experts." in name:
                modules[module.adapter] = EXPERT_ADAPTERS
                modules[module.to_wrap] = GEMMS
    for final in ("final_layernorm", "final_norm"):
        if getattr(model.decoder, final, None) is not None:
            modules[getattr(model.decoder, final)] = NORMS
    return modules, methods


class Ranges:
    """Forward hooks (and dispatcher method wrappers) that open a `bench::<component>` profiler
    range around each module's forward; removed on exit."""

    def __init__(self, model):
        self.modules, self.methods = component_ranges(model)
        self.handles, self.wrapped = [], []

    def __enter__(self):
        from torch.profiler import record_function

        for module, component in self.modules.items():
            stack = []

            def pre(_module, _args, stack=stack, component=component):
                stack.append(record_function(RANGE + component).__enter__())

            def post(_module, _args, _out, stack=stack):
                stack.pop().__exit__(None, None, None)

            self.handles += [module.register_forward_pre_hook(pre),
                             module.register_forward_hook(post)]
        for owner, method, component in self.methods:
            original = getattr(owner, method)

            def wrapper(*args, original=original, component=component, **kwargs):
                with record_function(RANGE + component):
                    return original(*args, **kwargs)

            self.wrapped.append((owner, method, vars(owner).get(method)))
            setattr(owner, method, wrapper)
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        for owner, method, own in self.wrapped:
            if own is None:
                delattr(owner, method)
            else:
                setattr(owner, method, own)


def _ancestors(event):
    while event is not None:
        yield event
        event = event.cpu_parent


def _range_of(event):
    """The component a `bench::` or package range names, or None for any other event."""
    if event.name.startswith(RANGE):
        return event.name[len(RANGE):]
    return PACKAGE_RANGES.get(event.name)


def _is_range(name: str) -> bool:
    return name.startswith(RANGE) or name in PACKAGE_RANGES


def _innermost_range(chain):
    return next((c for c in map(_range_of, chain) if c is not None), OTHER)


def _package_range_below(chain, node):
    """The component of the innermost package range between an op and its backward node (a
    range the fused path opened inside its backward), or None."""
    for event in chain:
        if event is node:
            return None
        if event.name in PACKAGE_RANGES:
            return PACKAGE_RANGES[event.name]
    return None


def _is_backward_node(event) -> bool:
    parent = event.cpu_parent
    return event.name.startswith(EVALUATE) or (parent is not None
                                               and parent.name == EVALUATE + event.name)


def classify(events, cuda: bool):
    """{component: µs} of the profiled ops' own GPU time (kernels they launched; on the CPU their
    own CPU time), the recompute's µs by the component it re-runs, the total device time of the
    profile (None on the CPU), {kernel name: µs} of the expert GEMMs' kernels and {source: µs}
    of what went to `other` (a backward node without a forward op, or the op's own name)."""
    from torch.autograd import DeviceType

    cpu_events = [e for e in events if e.device_type == DeviceType.CPU]
    forward = {}
    for event in cpu_events:
        if event.sequence_nr >= 0 and not _is_backward_node(event):
            forward.setdefault((event.thread, event.sequence_nr),
                               _innermost_range(_ancestors(event)))
    totals, recompute = dict.fromkeys(COMPONENTS, 0.0), dict.fromkeys(COMPONENTS, 0.0)
    gemm_kernels, other_sources = collections.Counter(), collections.Counter()
    other_gemm = 0.0
    for event in cpu_events:
        if getattr(event, "is_user_annotation", False) and event.name not in PACKAGE_RANGES:
            continue  # a range: its device span holds its ops' kernels, counted with those ops
        # A package range launches kernels of its own (the fused path's Triton kernels in a
        # backward node): those, or its own CPU time, are counted with it.
        kernels = [k for k in event.kernels if not _is_range(k.name)] if cuda else []
        own = sum(k.duration for k in kernels) if cuda else event.self_cpu_time_total
        if not own:
            continue
        chain = list(_ancestors(event))
        node = next((e for e in chain if e.name.startswith(EVALUATE)), None)
        if any(e.name == RANGE + OPTIMIZER for e in chain):
            component = OPTIMIZER
        elif node is None:
            component = _innermost_range(chain)
        elif node.name.endswith("CheckpointFunctionBackward"):
            component = RECOMPUTE
            recompute[_innermost_range(chain)] += own
        elif node.name.endswith("AccumulateGrad"):
            component = ADAPTERS
        else:
            component = (_package_range_below(chain, node)
                         or forward.get((node.fwd_thread, node.sequence_nr), OTHER))
        totals[component] += own
        if component == OTHER:
            other_sources[node.name[len(EVALUATE):] if node is not None else event.name] += own
        named = ([(k.name, k.duration) for k in kernels] if cuda else [(event.name, own)])
        if GEMMS in (component, _innermost_range(chain)):
            for name, us in named:
                gemm_kernels[name] += us
        if component == OTHER or (component == RECOMPUTE and _innermost_range(chain) == OTHER):
            other_gemm += sum(us for name, us in named if is_gemm_kernel(name))
    device_total = (sum(e.time_range.elapsed_us() for e in events
                        if e.device_type == DeviceType.CUDA
                        and not getattr(e, "is_user_annotation", False)
                        and not _is_range(e.name)) if cuda else None)
    return totals, recompute, device_total, gemm_kernels, other_sources, other_gemm


def is_gemm_kernel(name: str) -> bool:
    return bool(GEMM_KERNEL.search(name)) and not NOT_GEMM_KERNEL.search(name)


def moe_side(profile: dict) -> dict:
    """The MoE side of one profiled update pass (see the module's docstring): ms, its
    expert-GEMM kernel ms, their ratio, and the upper bound with all of `other` in it."""
    ms, again = profile["ms"], profile["recompute_ms"]
    moe = sum(ms[c] for c in MOE_SIDE) + sum(again[c] for c in MOE_SIDE)
    gemm = profile["gemm_kernel_ms"]
    bound = moe + ms[OTHER] + again[OTHER]
    return {"moe_ms": moe, "gemm_ms": gemm, "ratio": moe / gemm if gemm else None,
            "moe_bound_ms": bound, "ratio_bound": bound / gemm if gemm else None,
            "recompute_moe_ms": sum(again[c] for c in MOE_SIDE),
            "other_gemm_ms": profile["other_gemm_ms"]}


def moe_side_over_rounds(profiles) -> dict:
    """{"rounds": [moe_side of each profiled pass], key: {median, min, max}} over the passes."""
    rounds = [moe_side(p) for p in profiles]
    summary = {"rounds": rounds}
    for key in ("moe_ms", "gemm_ms", "ratio", "moe_bound_ms", "ratio_bound"):
        values = [r[key] for r in rounds if r[key] is not None]
        summary[key] = ({"median": statistics.median(values), "min": min(values),
                         "max": max(values)} if values else None)
    return summary


def profile_update(cycle, update_ms: float, device) -> dict:
    """One profiled update pass of `cycle` (cycle_passes.Cycle): {component: ms} (GPU idle = the
    measured update time minus the profiled device time), the recompute's ms by component, the
    profiled device time, the expert GEMMs' main kernels and the expert kernels the profiled
    pass ran (expert_kernels)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with cycle.environment(), Ranges(cycle.model), profile(activities=activities) as prof:
        cycle.update_pass()
        sync(device)
    started = time.perf_counter()
    totals, recompute, device_total, gemm_kernels, other_sources, other_gemm = classify(
        prof.events(), device.type == "cuda")
    attributed = sum(totals.values())
    if device_total is not None:  # device time no op claimed (e.g. kernels launched elsewhere)
        totals[OTHER] += max(0.0, device_total - attributed)
        other_sources[UNCLAIMED] += max(0.0, device_total - attributed)
    busy_ms = (device_total if device_total is not None else attributed) / 1e3
    ms = {k: v / 1e3 for k, v in totals.items()}
    ms[IDLE] = max(0.0, update_ms - busy_ms) if device.type == "cuda" else 0.0
    print(f"[cycle]   profile parsed in {time.perf_counter() - started:.1f} s", flush=True)
    return {"ms": ms, "recompute_ms": {k: v / 1e3 for k, v in recompute.items()},
            "expert_kernels": expert_kernels(cycle.model),
            "busy_ms": busy_ms, "idle_measured": device.type == "cuda",
            "gemm_kernel_ms": sum(us for name, us in gemm_kernels.items()
                                  if is_gemm_kernel(name)) / 1e3,
            "other_gemm_ms": other_gemm / 1e3,
            "gemm_kernels": [[name[:90], us / 1e3] for name, us in
                             gemm_kernels.most_common(TOP_KERNELS)],
            "other_sources": [[name[:90], us / 1e3] for name, us in
                              other_sources.most_common(TOP_KERNELS) if us > 0]}


def breakdown_table(rows) -> list:
    """Markdown lines: one row per component, ms / share / recompute ms per profiled arm."""
    profiled = [r for r in rows if "profile" in r]
    headers = ["component"] + [f"{r['module']} {unit}" for r in profiled
                               for unit in ("ms", "share", "recompute ms")]
    lines = []
    for component in COMPONENTS + ["total"]:
        cells = [component]
        for r in profiled:
            total = sum(r["profile"]["ms"].values())
            value = r["profile"]["ms"].get(component, total)
            again = r["profile"]["recompute_ms"]
            again = sum(again.values()) if component in (RECOMPUTE, "total") else again[component]
            cells += [f"{value:.1f}", f"{100 * value / total:.1f}%" if total else "—",
                      f"{again:.1f}" if again else ""]
        lines.append(cells)
    return markdown_table(headers, lines)


def kernel_lines(rows, key="gemm_kernels") -> list:
    """Markdown bullets: each profiled arm's main entries of `key` (ms in the update pass):
    "gemm_kernels", the expert GEMMs' kernels, or "other_sources", what went to `other`."""
    return [f"- {r['module']}: " + "; ".join(f"`{name}` {ms:.1f} ms"
                                             for name, ms in r["profile"][key])
            for r in rows if r.get("profile", {}).get(key)]


def plot_breakdown(rows, path, title) -> bool:
    """Stacked bars of the update pass by component, one bar per profiled arm."""
    profiled = [r for r in rows if "profile" in r]
    plt = pyplot()
    if plt is None or not profiled:
        return False
    fig, ax = plt.subplots(figsize=(4.5 + 1.8 * len(profiled), 5))
    colors = plt.get_cmap("tab20").colors
    bottoms = [0.0] * len(profiled)
    for i, component in enumerate(COMPONENTS):
        values = [r["profile"]["ms"][component] for r in profiled]
        ax.bar([r["module"].replace(", ", "\n") for r in profiled], values, 0.6, bottom=bottoms,
               label=component, color="lightgrey" if component == IDLE else colors[i % len(colors)])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_ylabel("update pass, ms")
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    save_figure(plt, fig, path)
    return True
