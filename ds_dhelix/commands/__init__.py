"""One module per ``dhelix`` subcommand, each with ``register(subparsers)`` (see ``ds_dhelix/cli.py``).
The top layer of the package: may import everything below it (``bench``, ``engine``, ``hf_models``,
...); nothing but ``cli`` imports it."""
