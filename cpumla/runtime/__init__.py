"""What every model family shares: the engine (positions, chunked prefill, truncate, generate), weight
formats and dummy weights, the safetensors reader, model resolution, loading, bench and smoke."""
