"""The jobs that consult the table of drafter kinds (kinds/): the checked recipe and the command line every
launcher shares, training, the planner, decoding and the data job's command. Nothing below kinds/ imports this
folder; eval/ and export/ build on it."""
