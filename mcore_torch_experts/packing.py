"""Expert weights packed in one buffer: the Parameters `weight0 .. weight{E-1}` of a module are
views of one contiguous, non-persistent buffer `packed_weight [E, out, in]`, and stay so whatever
is done to them.

- A new Parameter registered as `weightN` (assigned, `load_state_dict(..., assign=True)`) is cast
  into its slot at once when it is on the buffer's device and holds its own memory; otherwise,
  like a `.data` swap, it waits.
- Waiting replacements are packed at the next call of `packed()` (every forward) or carried
  through a cast or move of the module (`_apply`). Every source is read before any slot is
  written, so swaps and permutations come out right in any order; the buffer follows the
  weights to another device only when all of them moved there.
- A tensor that torch.func.functional_call substitutes for a weight (or for the buffer) is used
  for that call only, and neither it nor the buffer is written.
"""

import operator
from typing import List, Optional

import torch

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DTYPE = operator.attrgetter("dtype")

TRAINABLE_BASE_ERROR = (
    "TorchGroupedMLP runs frozen expert weights only: it builds them frozen, but {name}.{param} "
    "requires grad (set after the build, or a trainable replacement). Keep the expert base frozen "
    "(`p.requires_grad_(False)` for every `*.experts.linear_fc*.weight*`; adapters on top train), or "
    "build Megatron's experts to train them (moe_expert_gemm_backend='transformer_engine'; from a "
    "launcher, leave out the mcore_torch_experts spec)."
)


def _shares_memory(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether `tensor` lies in `buffer`'s storage."""
    return (tensor.device == buffer.device
            and tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr())


class PackedExpertWeights(torch.nn.Module):
    """`weight0 .. weight{E-1}` [out, in], frozen views of the non-persistent buffer
    `packed_weight` [E, out, in] (uninitialised); `name` prefixes error messages."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, *,
                 dtype: torch.dtype, device: torch.device, name: str):
        super().__init__()
        self.num_experts = num_experts
        self.name = name
        packed = torch.empty(num_experts, out_features, in_features, dtype=dtype, device=device)
        self.register_buffer("packed_weight", packed, persistent=False)
        self._packed = packed
        """The module's own buffer: what `packed_weight` holds, except while
        torch.func.functional_call substitutes a tensor for it (ignored: the weights count)."""
        self._register_load_state_dict_pre_hook(self._copy_views_of_the_buffer)
        self._weight_names = [f"weight{i}" for i in range(num_experts)]
        self._weight_index = {name: i for i, name in enumerate(self._weight_names)}
        self._own_weights: List[torch.nn.Parameter] = [None] * num_experts
        """The Parameter registered as each `weightN` (at construction or by a replacement);
        a tensor put in `_parameters` without registering (torch.func.functional_call) is a
        substitute for one call."""
        for i in range(num_experts):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(packed[i], requires_grad=False))

    def expert_weights(self) -> List[torch.Tensor]:
        """The tensors now held as `weight0 .. weight{E-1}` (substitutes during a
        torch.func.functional_call)."""
        return [self._parameters[name] for name in self._weight_names]

    def register_parameter(self, name: str, param: Optional[torch.nn.Parameter]) -> None:
        """Registering `weightN` (`linear.weightN = Parameter(...)`, `load_state_dict(...,
        assign=True)`) replaces that expert for good: its values are cast into its slot of the
        buffer and the Parameter becomes a view of it: at once when it is on the buffer's device
        and holds its own memory, else at the next forward (or cast or move of the module).
        The other experts are untouched; a shape mismatch is refused before anything changes."""
        index = self.__dict__.get("_weight_index", {}).get(name)
        if index is None:
            return super().register_parameter(name, param)
        expected = list(self._packed.shape[1:])
        if param is None or list(param.shape) != expected:
            got = None if param is None else list(param.shape)
            raise ValueError(f"{self.name}.{name}: a replacement must be a Parameter of shape "
                             f"{expected} (it is cast into the packed weight), got {got}")
        super().register_parameter(name, param)
        self._own_weights[index] = param
        if (param.device == self._packed.device and not self._views_slot(index, param)
                and not _shares_memory(param, self._packed)):
            self._repack([index])

    def _views_slot(self, index: int, weight: torch.Tensor) -> bool:
        """Whether `weight` is slot `index` of the buffer (by address: indexing the buffer would
        make a tensor each time)."""
        packed = self._packed
        return (weight.dtype == packed.dtype and weight.device == packed.device
                and weight.data_ptr() == self._slot_addresses()[index])

    def _stale(self) -> List[int]:
        """The registered weights that no longer view their slot (replaced, not yet packed)."""
        return [i for i, w in enumerate(self._own_weights) if not self._views_slot(i, w)]

    def packed(self, refuse_trainable: bool = False) -> torch.Tensor:
        """The packed weight [E, out, in] for this call.

        A registered `weightN` that no longer views its slot (`.data` swapped) is repacked for
        good. A substitute (torch.func.functional_call) is used for this call only: the weights
        are stacked into a temporary [E, out, in], and neither the buffer nor the substitute is
        written; a tensor substituted for `packed_weight` itself is neither used nor written.
        With `refuse_trainable`, a `weightN` that requires grad is an error.

        Every forward calls this: the usual case (every weight its own Parameter, viewing its
        slot) is decided by a few passes in C over the experts, the per-expert walk only runs
        when one of them says something changed.
        """
        weights = self.expert_weights()
        if refuse_trainable and any(map(_REQUIRES_GRAD, weights)):
            index = next(i for i, w in enumerate(weights) if w.requires_grad)
            raise RuntimeError(TRAINABLE_BASE_ERROR.format(name=self.name, param=f"weight{index}"))
        packed = self._packed
        if (self._buffers["packed_weight"] is packed
                and all(map(operator.is_, weights, self._own_weights))
                and list(map(torch.Tensor.data_ptr, weights)) == self._slot_addresses()
                and all(map(operator.is_, map(_DTYPE, weights), [packed.dtype] * len(weights)))):
            # The slot's address says the device too: CUDA and host allocations share one
            # virtual address space (UVA) without overlapping, and a meta tensor's address is 0.
            return packed
        stale, substituted = [], False
        for i, w in enumerate(weights):
            if w is not self._own_weights[i]:
                substituted = True
            elif not self._views_slot(i, w):
                stale.append(i)
        if stale:
            self._repack(stale)
        if substituted or self._buffers["packed_weight"] is not self._packed:
            return self._substituted_weight()
        return self._packed

    def _slot_addresses(self) -> List[int]:
        """The address of each expert's slot in the buffer (kept until the buffer changes)."""
        packed = self._packed
        key = (packed.data_ptr(), packed.stride(0), packed.element_size())
        if self.__dict__.get("_addresses_key") != key:
            step = packed.stride(0) * packed.element_size()
            self._addresses = [key[0] + i * step for i in range(self.num_experts)]
            self._addresses_key = key
        return self._addresses

    def _substituted_weight(self) -> torch.Tensor:
        """[E, out, in]: the weights held now, in the buffer's dtype and device."""
        packed = self._packed
        weights = self.expert_weights()
        for i, w in enumerate(weights):
            if w.shape != packed.shape[1:]:
                raise ValueError(f"{self.name}.weight{i}: the substitute has shape "
                                 f"{list(w.shape)}, expected {list(packed.shape[1:])}")
        return torch.stack([w.to(dtype=packed.dtype, device=packed.device) for w in weights])

    def _repack(self, stale: List[int]) -> None:
        """Pack the registered weights `stale` into the buffer; when every weight sits on one
        other device (moved one by one) the buffer follows them there."""
        target, stale = self._pack_target(stale)
        self._pack(target, stale)

    def _pack_target(self, stale: List[int]):
        """(buffer to pack into, weights to pack): the module's buffer and `stale`, or, when
        every weight sits on one other device, a new buffer there and all of them."""
        devices = {w.device for w in self._own_weights}
        if len(devices) == 1 and self._packed.device not in devices:
            return torch.empty_like(self._packed, device=devices.pop()), range(self.num_experts)
        return self._packed, stale

    def _pack(self, packed: torch.Tensor, stale, convert=None) -> None:
        """Make `packed` [E, out, in] the buffer: copy `convert(weight)` of the registered
        weights `stale` into their slots (cast to its dtype) and point them, and every weight
        not waiting to be packed, at their slots.

        Sources are read before any slot is written: a replaced weight that still lies in the
        old buffer (a `.data` swap, a permutation) is copied out of it first, so slots replaced
        in any order get the values they were given. The buffer is never an inference tensor,
        whatever mode this runs in."""
        own = self._own_weights
        expected = self._packed.shape[1:]
        for i in stale:
            if own[i].shape != expected:
                raise ValueError(f"{self.name}.weight{i} has shape {list(own[i].shape)}, "
                                 f"expected {list(expected)}")
        waiting = set(self._stale())
        with torch.no_grad(), torch.inference_mode(False):
            for i in waiting:
                if _shares_memory(own[i], self._packed):
                    own[i].data = own[i].data.clone()
            for i in stale:
                packed[i].copy_(own[i].data if convert is None else convert(own[i].data))
            self._buffers["packed_weight"] = self._packed = packed
            waiting.difference_update(stale)
            for i in range(self.num_experts):
                if i not in waiting:
                    self._point_at_slot(i)

    def _point_at_slot(self, index: int) -> None:
        """Make `weight{index}` a view of its slot. Tensors of different kinds (to or from the
        meta device) cannot share `.data`: the Parameter is replaced by one with the same
        attributes, as Module._apply does."""
        weight, slot = self._own_weights[index], self._packed[index]
        if torch._has_compatible_shallow_copy_type(weight, slot):
            weight.data = slot
            return
        new = torch.nn.Parameter(slot, requires_grad=weight.requires_grad)
        new.__dict__.update(weight.__dict__)
        self._parameters[self._weight_names[index]] = self._own_weights[index] = new

    def _apply(self, fn, recurse=True):
        """Move/cast the buffer once and keep every expert Parameter a view of it. A replacement
        still waiting to be packed (a `.data` swap, a Parameter on another device) goes through
        `fn` into its slot of the new buffer. Nothing here refuses, so a model is never left
        half-moved; to and from the meta device the expert Parameters are new objects with the
        same attributes, as Module._apply makes them."""
        own = self._own_weights
        grads = [None if w.grad is None else fn(w.grad) for w in own]
        target, stale = self._pack_target(self._stale())
        misfits = [i for i in stale if own[i].shape != self._packed.shape[1:]]
        for i in misfits:  # carried as they are; the next forward refuses them by name
            own[i].data = fn(own[i].data)
        self._pack(fn(target), [i for i in stale if i not in misfits], convert=fn)
        for weight, grad in zip(self._own_weights, grads):
            weight.grad = grad
        return self

    def _copy_views_of_the_buffer(self, state_dict, prefix, *args):
        """A state dict holding this module's own views (`state_dict()` permuted to reorder
        experts) is read before any slot is written: the entries that lie in the buffer, other
        than a weight's own slot, are copied first."""
        for i, name in enumerate(self._weight_names):
            value = state_dict.get(prefix + name)
            if (isinstance(value, torch.Tensor) and _shares_memory(value, self._packed)
                    and not (self._views_slot(i, value)
                             and value.stride() == self._packed.stride()[1:])):
                state_dict[prefix + name] = value.clone()
