"""The ``stream-rl`` command line: one ``*_cmd.py`` module per command group (``main.py`` assembles them) and the
root config with every role's section (``config.py``). The one layer that imports the roles: it hands each role
its own section, the shared sections and the agreements between roles.
"""
