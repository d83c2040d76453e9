"""Triton kernels: pure functions, each with a torch reference to test against.

paged_attention (prefill, chunked prefill and split-KV decode over block tables), kv_store (store by slot
mapping), rms_norm (plain and fused with the residual add), rotary (RoPE on Q and K in place, alone or fused
with the KV store), activation (SiLU-and-mul), varlen_attention (the packed encoder's attention), layer_norm
(the encoder's fused add-bias + residual + LayerNorm).
"""
