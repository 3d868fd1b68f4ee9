"""The private runtime behind :func:`shardfusion.fully_shard` (not public API; names may change).

- ``layout``: pure layout math of a flat buffer (offsets, padding, each rank's fragments).
- ``flat_buffer``: :class:`FlatBuffer`, one flat buffer of a unit: its tensors, their lifetimes, its collectives.
- ``unit``: :class:`Unit`, the parameters gathered and reduced together, and its state machine.
- ``scheduler``: :class:`Scheduler`, the hooks and when units all-gather, reshard, reduce-scatter and all-reduce.
- ``compile_disable``: the hooks' ``torch.compiler.disable``, importing ``torch._dynamo`` at their first call.
- ``wrap``: what ``fully_shard`` builds: units, parameter placement, the groups of each buffer, the checks.
- ``nested``: absorbing the units of earlier ``fully_shard`` calls on submodules (FSDP2's idiom).
- ``local_state_dict``: ``model.state_dict()`` / ``load_state_dict`` conventions of a sharded model.
- ``dtensor_state_dict``: full-shape DTensors from flat buffers (state dicts), and fragments back from them.
- ``optimizer_state_dict``: ``optimizer.state_dict()`` / ``load_state_dict`` hooks of an optimizer over fragments.
- ``optimizer_hook``: the optimizer step pre-hook (gradient sync, refusals).
- ``state``: the one accessor for a sharded model's runtime state.
- ``compress``: the compressed (bf16 / fp16 / block-wise int8) replicate all-reduce.
- ``gather_wire``, ``grad_wire``: the wire formats of the parameter all-gather (qwZ) and of the gradient
  reduce-scatter (int8, qgZ).
- ``secondary_shard``: hpZ's copy of a gathered buffer sharded within the node, and ``in_backward``.
"""
