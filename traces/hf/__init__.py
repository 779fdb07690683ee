"""kvsim's adapter to transformers models: everything kvsim does to a model lives here.

- `traces.hf.geometry`: what is read of the model -- its shape (`model_shape`: layers, heads, head_dim, positions,
  windows, per-layer kinds, context), each layer's attention (`layer_attention`: scale and window as its call ran
  it, RoPE base and scaling from the config) and a layer's output projection W_O (`output_projection`); and
  `UnsupportedModelError`, raised for a model kvsim cannot read or route.
- `traces.hf.routing`: the model's attention routed through kvsim (`routed`, one function registered with
  transformers' AttentionInterface and a pluggable handler per block; `attention_call`, `model_attention`).
- `traces.hf.forward`: the model run forward over its own KV cache a chunk at a time (`CachedForward`,
  `forward_in_chunks`), or at given positions without it (`forward_at`).

It sits at the bottom: it imports only `traces.format`, and the recorder (`traces.recorder`, `traces.capture`,
`traces.faithful`), the closed-loop runner (`gpu_validate`) and the benchmarks import it. Loading a model is
`traces.models`.
"""
