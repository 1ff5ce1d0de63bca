"""Quality of compressed caches on a real model: ``numba-kv eval`` (:mod:`.evaluate`, llama.cpp-style
KL statistics vs the dense cache) and ``numba-kv analyze`` (:mod:`.analysis`, where the loss comes
from: keys vs values, per layer, per head)."""
