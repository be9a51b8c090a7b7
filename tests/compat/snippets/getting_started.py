"""DeepSpeed's getting-started guide (training, then saving and loading checkpoints), as its users
write it, with ``import deepspeed`` changed to the line below and nothing else but the sizes.

``deepspeed.initialize(args=cmd_args, model=model, model_parameters=params)``, the engine's
forward / ``backward`` / ``step``, ``save_checkpoint(save_dir, ckpt_id, client_state)`` every
``save_interval`` steps with the step in the client state, and
``_, client_sd = load_checkpoint(load_dir, ckpt_id)`` resuming from it.
"""

import infinity.compat.deepspeed as deepspeed


def train(cmd_args, model, data_loader):
    """The training loop of the guide; returns each step's loss."""
    model_engine, optimizer, _, _ = deepspeed.initialize(
        args=cmd_args, model=model, model_parameters=model.parameters()
    )
    losses = []
    for step, batch in enumerate(data_loader):  # noqa: B007 (the guide's loop)
        # forward() method
        loss = model_engine(batch)

        # runs backpropagation
        model_engine.backward(loss)

        # weight update
        model_engine.step()
        losses.append(loss.item())
    model_engine.destroy()
    return losses


def train_with_checkpoints(args, model, data_loader):
    """The guide's checkpointing loop: saves every ``args.save_interval`` steps, tagged by the loss;
    returns the losses and the tags saved."""
    model_engine, optimizer, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    client_sd = {}
    losses, tags = [], []
    for step, batch in enumerate(data_loader):
        # forward() method
        loss = model_engine(batch)
        # runs backpropagation
        model_engine.backward(loss)
        # weight update
        model_engine.step()
        losses.append(loss.item())

        # save checkpoint
        if (step + 1) % args.save_interval == 0:
            client_sd["step"] = step
            ckpt_id = loss.item()
            model_engine.save_checkpoint(args.save_dir, ckpt_id, client_state=client_sd)
            tags.append(str(ckpt_id))
    model_engine.destroy()
    return losses, tags


def resume(args, model, data_loader):
    """The guide's resume: load the checkpoint, advance the data to its step, train on; returns
    the ``(load_path, client_sd)`` the load gave and the losses after it."""
    model_engine, optimizer, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    # load checkpoint
    load_path, client_sd = model_engine.load_checkpoint(args.load_dir, args.ckpt_id)
    step = client_sd["step"]

    losses = []
    for i, batch in enumerate(data_loader):
        if i <= step:  # advance data loader to ckpt step
            continue
        loss = model_engine(batch)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
    model_engine.destroy()
    return (load_path, client_sd), losses
