"""The routing modes the loader installs (models/loader.install_routers), in a module that imports
nothing, so that the configuration can check a name without loading a router.
auto = group_limited when the checkpoint has n_group/topk_group, else flat."""

ROUTING_MODES = ("auto", "flat", "group_limited", "hierarchical")
