"""GPU worker pools: engine adapters, the continuous-batching loop and the worker bootstrap."""
