"""Drop-in modules that speak other libraries' APIs (``compat.flash_attn``)."""
