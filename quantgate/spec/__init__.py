"""What a release spec says: its model and sections (`schema`, `sections`), how it is resolved before any work
(`resolve`: schemes, hardware, the model family's support, `auto` schemes), the variants it names from elsewhere
(`external`), and the warnings `quantgate check` prints about it (`warn`). Pure reading and validation: nothing here
serves, measures or writes a run."""
