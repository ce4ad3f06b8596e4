"""Training weights that tokenmill's plugins load: ``tokenmill train medusa`` (``tokenmill.train.medusa``).

Nothing is imported here: ``tokenmill --help`` stays free of torch.
"""
