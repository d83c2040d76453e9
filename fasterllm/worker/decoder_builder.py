"""A decoder model ready to run: built from a checkpoint, weights loaded, quantized or packed for its device."""
from __future__ import annotations

import torch

from fasterllm.config import PREQUANTIZED_METHODS
from fasterllm.distributed.tensor_parallel import SINGLE_DEVICE, TensorParallel, check_tensor_parallel
from fasterllm.layers.linear import can_pack
from fasterllm.layers.quantization import check_stored_supported, check_supported, quantize_model
from fasterllm.layers.quantization.gguf import prepare_gguf_linears
from fasterllm.layers.quantization.stored import prepare_stored_linears
from fasterllm.loader.checkpoint import Checkpoint
from fasterllm.loader.dummy_weights import fill_dummy_weights
from fasterllm.models.registry import model_class


def build_decoder(checkpoint: Checkpoint, max_model_len: int, device: torch.device, dtype: torch.dtype,
                  load_format: str = "auto", quantization: str | None = None, with_head: bool = True,
                  tp: TensorParallel = SINGLE_DEVICE) -> torch.nn.Module:
    """The checkpoint's decoder on device with its weights loaded (or random: load_format='dummy'), quantized
    when asked, packed for oneDNN on the CPU, its float linears on a GPU taking one row through gemv.py. tp: this
    rank's shard of a tensor-parallel model (read from the checkpoint alone).
    with_head=False (embeddings read hidden_states() only): the output head is dropped after loading, so no
    copy of it is quantized, packed or kept."""
    quantization = checkpoint.resolve_quantization(quantization)
    check_supported(quantization, device)  # refused before any weight loads
    if quantization in PREQUANTIZED_METHODS:
        what = f"{checkpoint.source.path} ({checkpoint.stored.name})"
        check_stored_supported(checkpoint.stored_layout, device, what)
        if getattr(checkpoint.config, "num_experts", 0):
            raise ValueError(f"{what} is a mixture of experts, whose stored expert codes are not loaded yet; use a "
                             "float checkpoint of it (with load_format='dummy': a config without quantization_config, "
                             "and quantization='int4' to quantize its random weights)")
    config = checkpoint.config
    check_tensor_parallel(config, quantization, tp.size)
    cls = model_class(config.architecture)
    model = cls(config, max_model_len, device, dtype) if tp.size == 1 else cls(config, max_model_len, device, dtype, tp)
    if quantization in PREQUANTIZED_METHODS:  # the projections hold the checkpoint's codes as stored
        prepare_stored_linears(model, checkpoint.stored_layout, checkpoint.stored.input_order,
                               checkpoint.stored.held_group_size)
    if load_format == "dummy":  # random weights (random codes for a pre-quantized checkpoint) through the same layers
        fill_dummy_weights(model)
    elif quantization == "gguf":  # the projections take the file's blocks as stored
        weights = checkpoint.require_native_block_weights()
        prepare_gguf_linears(model, checkpoint.native_block_layouts)
        model.load_weights(weights())
    elif quantization in PREQUANTIZED_METHODS:
        model.load_weights(checkpoint.weights())
    elif tp.size > 1:
        model.load_weights(checkpoint.weight_parts())
    else:
        model.load_weights(checkpoint.weights())
    if with_head:
        model.head_as_linear()  # a tied head too: replaced below like the projections
    else:
        model.lm_head = torch.nn.Identity()  # never called: forward() would return the hidden states
    if quantization is not None:
        # the output head too (a tied head: a quantized copy); a pre-quantized checkpoint's stored codes as stored
        quantize_model(model, quantization, device, checkpoint.stored_layout)
    elif device.type == "cuda":  # batch-1 decode through the matrix-vector kernel, the head too
        from fasterllm.layers.gpu_linear import use_gemv_linears  # Triton: only with CUDA

        use_gemv_linears(model)
    if can_pack(device, dtype):
        model.pack_for_cpu()
    if device.type == "cpu":
        if hasattr(model, "use_cpu_decode_stack"):  # Llama's and the BART family's
            model.use_cpu_decode_stack()
    return model
