"""The MoE layer users call: `fused_moe` (a function) and `MoELayer` (an nn.Module), on one
kernel sequence (`runner`), with a persistent `Workspace`, LoRA through typed hooks, weight
processing from GPTQ / AWQ / compressed-tensors / Marlin / NVFP4 checkpoints into the
kernel layout, and a backend oracle.

    config = MoEConfig(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768,
                       quant=QuantScheme("gptq", bits=4, group_size=128))
    layer = MoELayer(config, max_tokens=256)
    layer.load_weights(w1=gate, w2=down, w3=up)        # checkpoint tensors, stacked (E, ...)
    out = layer(hidden_states, router_logits)          # (M, H)
"""

from .batched import BatchedWorkspace, batched_moe
from .config import MoEConfig, QuantScheme
from .hooks import GemmStep, MoEHooks
from .layer import MoELayer
from .lora import LoRAAdapter, LoRAHooks
from .oracle import Backend, select_backend
from .runner import Inputs, check_inputs, forward, fused_moe, prepare, run
from .weights import ExpertWeights, process_weights_after_loading
from .workspace import Workspace, WorkspaceTooSmall

__all__ = [
    "Backend", "BatchedWorkspace", "ExpertWeights", "GemmStep", "Inputs", "LoRAAdapter", "LoRAHooks", "MoEConfig",
    "MoEHooks", "MoELayer", "QuantScheme", "Workspace", "WorkspaceTooSmall", "batched_moe", "check_inputs",
    "forward", "fused_moe", "prepare", "process_weights_after_loading", "run", "select_backend",
]
