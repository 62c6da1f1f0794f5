"""The exported draft's format, as SGLang 0.5.23 loads it: its architecture name and its tensor names.

Both sides read it from here: the trainer's export (`pipeline/train/export.py`) writes these names, and
SGLang's load rules (`pipeline/draft/sglang.py`) check them; neither imports the other for them. Torch-free.
"""

ARCH = "LlamaForCausalLMEagle3"

# trainer module name → SGLang tensor name (identical by construction; listed so nothing extra slips out)
NAMES = ("fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
         "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
         "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
         "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
         "norm.weight", "lm_head.weight", "d2t", "t2d")
