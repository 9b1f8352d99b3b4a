"""ComfyUI custom node: "Patch attention (flashtriton)".

Install: this repository into ComfyUI's Python (pip install -e path/to/flashtriton), then link
or copy this folder into ComfyUI/custom_nodes/. Wire MODEL -> Patch attention (flashtriton) -> KSampler.
The node sets the model's attention override, replacing any override that a node before it set
(another attention patch, "Model attention backend"); calls the kernels cannot run go to
ComfyUI's own attention. Importing this folder also registers the function as "flashtriton"
with ComfyUI's attention registry (newer ComfyUI), where other nodes can select it by name.
"""

from flashtriton.integrations.comfyui import attention_override, register

register()


class PatchAttentionFlashtriton:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "enabled": ("BOOLEAN", {"default": True})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "model_patches"
    DESCRIPTION = ("Runs the model's attention on flashtriton's Triton kernels; calls they do not "
                   "support go to ComfyUI's own attention. Replaces any attention override set "
                   "by a node before it.")

    def patch(self, model, enabled=True):
        """A clone of model whose transformer_options["optimized_attention_override"] is
        flashtriton's (whatever override the model had before is replaced)."""
        if not enabled:
            return (model,)
        patched = model.clone()
        options = patched.model_options.setdefault("transformer_options", {})
        options["optimized_attention_override"] = attention_override
        return (patched,)


NODE_CLASS_MAPPINGS = {"PatchAttentionFlashtriton": PatchAttentionFlashtriton}
NODE_DISPLAY_NAME_MAPPINGS = {"PatchAttentionFlashtriton": "Patch attention (flashtriton)"}
