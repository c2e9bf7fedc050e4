"""The optimizer study as a package: a sweep's plan of cells (``plan``), how the settings are searched (``search``:
the grid or coordinate descent), how runs are scheduled (``scheduling``), what each run folder holds
(``run_folders``), the numbers (``summary`` and its pure ``statistics``), and the page (``report`` and
``figures``); ``sweep`` joins them. The command line is ``python -m torchtitan.tools.sweep``."""
