"""The router variants of the MoE matcher, one per file (``passes/_moe/router.py`` lists them in
``ROUTER_VARIANTS``, tried in order): a new variant is one part file and one row there."""
