"""Hydra configuration files shipped with batchgen (installed as ``batchgen.conf``)."""
