"""Training weights that tokenmill's plugins load: ``tokenmill train medusa``
(``tokenmill_plugins.commands.train.medusa``).

Nothing is imported here: ``tokenmill --help`` stays free of torch.
"""
