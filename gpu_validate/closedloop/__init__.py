"""The closed loop: a real model decoding over a policy-compressed cache, batched, with the host-side policy steps and
the full-cache reference."""
