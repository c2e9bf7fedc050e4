"""The job config's tables, one module per group of the TOML file: every option, its default, its one-line help
and its range checks (``ge``, ``gt``, ``lt``, ``le``, ``choices``), read alike by the TOML loader, the command line and
``--help`` (``torchtitan.config.parsing``)."""
