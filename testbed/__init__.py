"""testbed: real-network emulation of bit errors on data-center links, and what they do to AI training."""

__version__ = "0.1.0"
