"""Other libraries' public names mapped onto zkit's API (``zkit.compat.deepspeed``)."""
