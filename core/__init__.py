"""The recipe schema and loader, the command line every launcher shares, errors and crash-safe file I/O."""
