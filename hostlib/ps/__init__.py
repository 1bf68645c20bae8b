"""The parameter-server client side (``lta ps``): the worker's client, the exchange's payloads, the robust
aggregation rules and the gradient compressors both ends use."""
