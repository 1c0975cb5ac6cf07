"""Sub-commands of the ``flowspec`` CLI, one module each (see ``flowspec_p2p.cli``)."""
