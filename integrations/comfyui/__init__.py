"""ComfyUI custom node: "Patch attention (flashtriton)".

Install: pip install flashtriton (or this repository) into ComfyUI's Python, then link or copy
this folder into ComfyUI/custom_nodes/. Wire MODEL -> Patch attention (flashtriton) -> KSampler.
"""

from flashtriton.integrations.comfyui import attention_flashtriton, attention_override


class PatchAttentionFlashtriton:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "enabled": ("BOOLEAN", {"default": True})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "model_patches"
    DESCRIPTION = ("Runs the model's attention on flashtriton's Triton kernels; calls they do not "
                   "support go to ComfyUI's own attention.")

    def patch(self, model, enabled=True):
        if not enabled:
            return (model,)
        try:  # newer ComfyUI: make the function selectable by name too
            from comfy.ldm.modules.attention import register_attention_function
            register_attention_function("flashtriton", attention_flashtriton)
        except (ImportError, ValueError):
            pass
        patched = model.clone()
        options = patched.model_options.setdefault("transformer_options", {})
        options["optimized_attention_override"] = attention_override
        return (patched,)


NODE_CLASS_MAPPINGS = {"PatchAttentionFlashtriton": PatchAttentionFlashtriton}
NODE_DISPLAY_NAME_MAPPINGS = {"PatchAttentionFlashtriton": "Patch attention (flashtriton)"}
