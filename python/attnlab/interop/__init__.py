"""PyTorch weights in: keyword arguments for attnlab's functions from PyTorch state dicts.

Each loader takes a module's ``state_dict()`` (values may be NumPy arrays or torch tensors; torch
is never imported here) and returns the keyword arguments of the matching attnlab call, ready
for ``f(x, **kwargs)``:

- :func:`from_torch_mha`: ``torch.nn.MultiheadAttention`` -> ``multi_head_attention`` (also
  takes the module itself, which lets it detect ``add_zero_attn=True``)
- :func:`from_vit_pytorch`: vit-pytorch (lucidrains) ``Attention`` -> ``multi_head_attention``
- :func:`from_swiftformer`: SwiftFormer's efficient additive attention (official, timm,
  Hugging Face) -> ``additive_attention``
- :func:`from_mobilevitv2`: MobileViT-v2's ``LinearSelfAttention`` (ml-cvnets, timm, Hugging
  Face) -> ``separable_attention``
- :func:`from_transformers`: Hugging Face ``transformers`` attention modules (BERT, ViT, GPT-2,
  Llama, Mistral, Mixtral, Qwen2/3, Gemma 1/2/3, gpt-oss, Phi-3, GPT-NeoX, Falcon, BLOOM, MPT)
  -> ``multi_head_attention``, :func:`transformers_masks` for their attention masks and
  :func:`t5_position_bias` for T5's relative position bias as a float ``mask``
- :func:`torch_masks`: PyTorch's ``attn_mask`` / ``key_padding_mask`` -> ``mask=``,
  ``key_padding_mask=`` (boolean polarity inverted)

PyTorch's ``nn.Linear`` stores weights as ``(out, in)``; attnlab's are ``(in, out)`` with
``y = x @ W + b``, so every weight is transposed (and copied: the result does not change when
the model trains on). The dtype is kept (bfloat16 tensors become float32).

Keys may carry a leading prefix (``encoder.layers.0.self_attn.in_proj_weight``): a loader finds
the module's keys by their names and strips the prefix. When the dict holds more than one such
module, or keys outside the module, pass ``prefix=`` to choose one (keys outside it are then
ignored; ``"enc.1"`` means ``"enc.1."``, so it does not take ``enc.10.*``).
"""

from ._masks import torch_masks
from ._mobilevit import from_mobilevitv2
from ._swiftformer import from_swiftformer
from ._t5 import t5_position_bias
from ._torch_mha import from_torch_mha
from ._transformers import from_transformers, transformers_masks
from ._vit_pytorch import from_vit_pytorch

__all__ = [
    "from_mobilevitv2",
    "from_swiftformer",
    "from_torch_mha",
    "from_transformers",
    "from_vit_pytorch",
    "t5_position_bias",
    "torch_masks",
    "transformers_masks",
]
