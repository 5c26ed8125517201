"""Runtime: model state, latent cache, prefill and decode (see the runtime issue)."""
