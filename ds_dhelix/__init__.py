"""ds_dhelix: DHelix strand interleaving for DeepSpeed."""
__version__ = "0.1.0"
