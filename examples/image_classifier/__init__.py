"""An image classifier (a small CNN) on PNG files, written as a TrainSpec: model, data, loss and metric only."""
