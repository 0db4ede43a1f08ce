"""``python -m batchgen``: the ``batchgen`` command (:func:`batchgen.cli.main`), same arguments and exit
statuses."""

from batchgen.cli import main

if __name__ == "__main__":
    main()
