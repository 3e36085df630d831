/**
 * The left-sidebar panel: a summary and one card per kernel.
 */
import { Notification } from '@jupyterlab/apputils';
import { ReactWidget } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import * as React from 'react';

import { formatBytes, formatDuration, formatPercent } from './format';
import { CedanaModel } from './model';
import { IBudget, IKernel } from './types';

/** Keep-awake durations offered, in seconds. */
export const KEEP_AWAKE_CHOICES: ReadonlyArray<{
  label: string;
  seconds: number;
}> = [
  { label: '15 minutes', seconds: 15 * 60 },
  { label: '1 hour', seconds: 3600 },
  { label: '4 hours', seconds: 4 * 3600 },
  { label: '1 day', seconds: 86400 },
  { label: '1 week', seconds: 7 * 86400 }
];

/**
 * What a kernel's checkpoint holds on disk, and a tooltip that explains it: a whole
 * image, an incremental image on its bases, or a running kernel's kept base.
 */
export function checkpointText(kernel: IKernel): {
  text: string;
  title: string;
} {
  const disk = kernel.checkpoint_disk;
  const total = kernel.checkpoint_bytes;
  // An event may have changed the size since the split was read: the size wins.
  if (!disk || disk.image_bytes + disk.base_bytes !== total || total <= 0) {
    return {
      text: total > 0 ? formatBytes(total) : '–',
      title: 'Checkpoint size'
    };
  }
  const bases = disk.layers - 1;
  if (disk.kept_base) {
    return {
      text: `${formatBytes(total)} kept as base`,
      title:
        'The image this kernel was resumed from, kept so that its next suspend ' +
        'writes only what changed; dropped first when the checkpoint disk needs room' +
        (bases > 0 ? ` (${disk.layers} images in its chain)` : '')
    };
  }
  if (bases > 0) {
    return {
      text: `${formatBytes(disk.image_bytes)} + ${formatBytes(disk.base_bytes)} base`,
      title:
        `An incremental image of ${formatBytes(disk.image_bytes)} on ` +
        `${bases} base${bases === 1 ? '' : 's'} of ${formatBytes(disk.base_bytes)}: ` +
        `${formatBytes(total)} on disk`
    };
  }
  return { text: formatBytes(total), title: 'Checkpoint size (a whole image)' };
}

/** What the buttons of a kernel may do now. */
export function allowedActions(
  kernel: IKernel,
  pending: boolean
): { suspend: boolean; resume: boolean; keepAwake: boolean } {
  return {
    suspend:
      !pending &&
      kernel.state === 'running' &&
      kernel.suspendable &&
      !kernel.queued,
    resume:
      !pending && (kernel.state === 'suspended' || kernel.state === 'failed'),
    keepAwake: !pending && kernel.state === 'running'
  };
}

/** The note about images no kernel owns. */
export function orphansText(budget: IBudget): string {
  const n = budget.orphaned_images;
  return `${n} checkpoint image${n === 1 ? '' : 's'} (${formatBytes(budget.orphaned_bytes)}) belong${n === 1 ? 's' : ''} to no kernel, left by a crash; \`jupyter cedana gc\` removes them.`;
}

/** Show a failed request's reason as a notification. */
export function notifyError(what: string, error: unknown): void {
  const message =
    error instanceof Error ? error.message : String(error ?? 'unknown error');
  Notification.error(`${what}: ${message}`, { autoClose: 10000 });
}

/** The badge text of a kernel: its state and tier, and what it waits for. */
export function badgeText(kernel: IKernel): string {
  let text: string = kernel.state;
  if (kernel.tier && kernel.state !== 'running') {
    text = `${kernel.state} · ${kernel.tier}`;
  }
  if (kernel.queued) {
    text += ` · queued to ${kernel.queued.action}`;
  }
  return text;
}

/** Where a waiting suspend or resume stands, or null. */
export function queueText(kernel: IKernel): string | null {
  const queued = kernel.queued;
  if (!queued) {
    return null;
  }
  const place =
    queued.position === 1 ? 'next in line' : `#${queued.position} in line`;
  return `Waiting for a free ${queued.action} slot (${place}): other kernels are being ${queued.action === 'suspend' ? 'suspended' : 'resumed'}.`;
}

/** Why automatic suspend does not happen now, when it backs off; or null. */
export function backoffText(kernel: IKernel): string | null {
  const backoff = kernel.backoff;
  if (!backoff || kernel.state !== 'running') {
    return null;
  }
  return kernel.reason ?? `Automatic suspend failed: ${backoff.reason}`;
}

/** The Suspend button's tooltip. */
export function suspendTitle(kernel: IKernel): string {
  if (kernel.queued?.action === 'suspend') {
    return 'A suspend of this kernel waits for a free slot';
  }
  if (kernel.state === 'running' && !kernel.suspendable) {
    return kernel.reason ?? 'Cannot be suspended now';
  }
  if (kernel.backoff) {
    return kernel.backoff.not_checkpointable
      ? `Not checkpointable as it is (${kernel.backoff.reason}); Suspend tries anyway`
      : `Automatic suspend failed (${kernel.backoff.reason}); Suspend tries now`;
  }
  return 'Checkpoint this kernel to disk and free its GPU';
}

function basename(path: string): string {
  const parts = path.split('/');
  return parts[parts.length - 1] || path;
}

interface IKernelCardProps {
  model: CedanaModel;
  kernel: IKernel;
  path: string | null;
}

function KernelCard(props: IKernelCardProps): JSX.Element {
  const { model, kernel, path } = props;
  const [seconds, setSeconds] = React.useState<number>(
    KEEP_AWAKE_CHOICES[1].seconds
  );
  const pending = model.isPending(kernel.id);
  const allowed = allowedActions(kernel, pending);
  const gpuTotal = model.gpuMemory(kernel);
  const freed = model.gpuMemoryFreed(kernel);
  const countdown = model.secondsUntilSuspend(kernel);
  const keepAwake = model.keepAwakeSecondsLeft(kernel);
  const progress = kernel.progress;
  const waiting = queueText(kernel);
  const backoff = backoffText(kernel);
  const checkpoint = checkpointText(kernel);

  const run = (what: string, action: () => Promise<unknown>) => {
    action().catch(error => notifyError(what, error));
  };

  return (
    <li
      className={`jp-cedana-kernel jp-cedana-state-${kernel.state}`}
      data-kernel-id={kernel.id}
      data-state={kernel.state}
    >
      <div className="jp-cedana-kernel-header">
        <span className="jp-cedana-kernel-name" title={path ?? kernel.id}>
          {path ? basename(path) : `Kernel ${kernel.id.slice(0, 8)}`}
        </span>
        <span
          className={`jp-cedana-badge jp-cedana-badge-${kernel.state}`}
          data-state={kernel.state}
          data-tier={kernel.tier ?? ''}
          data-queued={kernel.queued?.action ?? ''}
          title={kernel.reason ?? undefined}
        >
          {badgeText(kernel)}
        </span>
      </div>
      <div className="jp-cedana-kernel-sub">
        <span className="jp-cedana-kernelspec">{kernel.name}</span>
        {path && (
          <span className="jp-cedana-path" title={path}>
            {path}
          </span>
        )}
      </div>
      <dl className="jp-cedana-facts">
        <dt>GPU</dt>
        <dd className="jp-cedana-gpu">
          {kernel.state === 'suspended' ? (
            <span>
              {freed > 0 ? `${formatBytes(freed)} freed` : 'none held'}
            </span>
          ) : kernel.gpus.length === 0 ? (
            <span className="jp-cedana-muted">none</span>
          ) : (
            <>
              {kernel.gpus.map(gpu => (
                <span
                  key={gpu.uuid || gpu.index}
                  className="jp-cedana-gpu-item"
                  title={`${gpu.uuid}: ${formatBytes(gpu.memory_bytes)}, utilisation ${formatPercent(gpu.utilization)}`}
                >
                  #{gpu.index} {formatBytes(gpu.memory_bytes)} ·{' '}
                  {formatPercent(gpu.utilization)}
                </span>
              ))}
              {kernel.gpus.length > 1 && (
                <span className="jp-cedana-gpu-total">
                  total {formatBytes(gpuTotal)}
                </span>
              )}
            </>
          )}
        </dd>
        <dt>Idle</dt>
        <dd className="jp-cedana-idle">
          {formatDuration(model.idleSeconds(kernel))}
          {kernel.execution_state && kernel.execution_state !== 'idle'
            ? ` (${kernel.execution_state})`
            : ''}
        </dd>
        <dt>Suspend</dt>
        <dd
          className="jp-cedana-countdown"
          data-seconds={countdown === null ? '' : String(Math.round(countdown))}
          title="Time left before the automatic suspend"
        >
          {countdown !== null
            ? `in ${formatDuration(countdown)}`
            : keepAwake === null
              ? kernel.state === 'running'
                ? 'not planned'
                : '–'
              : ''}
          {keepAwake !== null && (
            <span className="jp-cedana-keep-awake">
              kept awake {formatDuration(keepAwake)}
            </span>
          )}
        </dd>
        <dt>Image</dt>
        <dd className="jp-cedana-checkpoint" title={checkpoint.title}>
          {checkpoint.text}
        </dd>
        <dt>Took</dt>
        <dd
          className="jp-cedana-durations"
          title="Duration of the last suspend and of the last resume"
        >
          {kernel.last_suspend_seconds === null &&
          kernel.last_resume_seconds === null
            ? '–'
            : `suspend ${formatDuration(kernel.last_suspend_seconds)} · resume ${formatDuration(kernel.last_resume_seconds)}`}
        </dd>
      </dl>
      {progress &&
        (kernel.state === 'suspending' || kernel.state === 'resuming') && (
          <div className="jp-cedana-progress" title={progress.phase}>
            <progress max={1} value={progress.fraction ?? 0} />
            <span>
              {progress.phase} {Math.round((progress.fraction ?? 0) * 100)} %
              {progress.bytes_total
                ? ` (${formatBytes(progress.bytes_done ?? 0)} / ${formatBytes(progress.bytes_total)})`
                : ''}
            </span>
          </div>
        )}
      {waiting && (
        <div className="jp-cedana-queued" data-action={kernel.queued?.action}>
          {waiting}
        </div>
      )}
      {backoff ? (
        <div
          className={`jp-cedana-reason jp-cedana-backoff${kernel.backoff?.not_checkpointable ? ' jp-cedana-not-checkpointable' : ''}`}
          title={kernel.backoff?.reason}
        >
          {backoff}
        </div>
      ) : (
        kernel.reason && (
          <div
            className={`jp-cedana-reason${kernel.state === 'failed' ? ' jp-cedana-error' : ''}`}
          >
            {kernel.reason}
          </div>
        )
      )}
      <div className="jp-cedana-actions">
        <button
          className="jp-mod-styled jp-cedana-suspend"
          disabled={!allowed.suspend}
          title={suspendTitle(kernel)}
          onClick={() => run('Suspend failed', () => model.suspend(kernel.id))}
        >
          {pending && model.pendingAction(kernel.id) === 'suspend'
            ? kernel.queued
              ? 'Queued…'
              : 'Suspending…'
            : 'Suspend'}
        </button>
        <button
          className="jp-mod-styled jp-cedana-resume"
          disabled={!allowed.resume}
          title="Resume this kernel now"
          onClick={() => run('Resume failed', () => model.resume(kernel.id))}
        >
          {pending && model.pendingAction(kernel.id) === 'resume'
            ? kernel.queued
              ? 'Queued…'
              : 'Resuming…'
            : 'Resume'}
        </button>
        <span className="jp-cedana-keep-awake-group">
          <button
            className="jp-mod-styled jp-cedana-keep-awake-button"
            disabled={!allowed.keepAwake}
            title="Postpone automatic suspend"
            onClick={() =>
              run('Keep awake failed', () =>
                model.keepAwake(kernel.id, seconds)
              )
            }
          >
            Keep awake
          </button>
          <select
            className="jp-cedana-keep-awake-select"
            aria-label="Keep awake for"
            value={seconds}
            disabled={!allowed.keepAwake}
            onChange={event => setSeconds(Number(event.target.value))}
          >
            {KEEP_AWAKE_CHOICES.map(choice => (
              <option key={choice.seconds} value={choice.seconds}>
                {choice.label}
              </option>
            ))}
          </select>
        </span>
      </div>
    </li>
  );
}

/** The totals at the top of the panel. */
function Summary(props: { model: CedanaModel }): JSX.Element {
  const { model } = props;
  const summary = model.summary;
  const status = model.status;
  return (
    <div className="jp-cedana-summary">
      <div className="jp-cedana-summary-item">
        <span className="jp-cedana-summary-value jp-cedana-freed">
          {formatBytes(summary.gpuMemoryFreed)}
        </span>
        <span className="jp-cedana-summary-label">GPU freed</span>
      </div>
      <div className="jp-cedana-summary-item">
        <span className="jp-cedana-summary-value jp-cedana-suspended-count">
          {summary.suspended} / {summary.total}
        </span>
        <span className="jp-cedana-summary-label">suspended</span>
      </div>
      <div
        className="jp-cedana-summary-item"
        title={
          status
            ? `Disk used by checkpoints under ${status.checkpoint_root}; ${formatBytes(status.bytes_free)} free`
            : 'Disk used by checkpoints'
        }
      >
        <span className="jp-cedana-summary-value jp-cedana-disk">
          {formatBytes(summary.checkpointBytes)}
        </span>
        <span className="jp-cedana-summary-label">checkpoints</span>
      </div>
    </div>
  );
}

/**
 * The sidebar panel.
 */
export class CedanaPanel extends ReactWidget {
  constructor(model: CedanaModel) {
    super();
    this.model = model;
    this.id = 'jupyter-cedana-panel';
    this.addClass('jp-cedana-panel');
    this.title.caption = 'Kernel suspend';
    model.changed.connect(this._onChange, this);
  }

  readonly model: CedanaModel;

  dispose(): void {
    this._stopTicker();
    this.model.changed.disconnect(this._onChange, this);
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this._startTicker();
    void this.model.refresh();
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this._stopTicker();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    if (this.isVisible) {
      this._startTicker();
    }
  }

  protected onBeforeDetach(msg: Message): void {
    this._stopTicker();
    super.onBeforeDetach(msg);
  }

  render(): JSX.Element {
    const model = this.model;
    const paths = model.paths();
    const status = model.status;
    const kernels = model.kernels;
    return (
      <div className="jp-cedana-content">
        <header className="jp-cedana-header">
          <h2>Kernel suspend</h2>
          <button
            className="jp-mod-styled jp-cedana-refresh"
            title="Refresh"
            onClick={() => void model.refresh()}
          >
            ⟳
          </button>
        </header>
        <Summary model={model} />
        {status && !status.available && (
          <div className="jp-cedana-warning jp-cedana-unavailable">
            Checkpointing is unavailable: {status.reason ?? 'unknown reason'}
          </div>
        )}
        {status && status.available && !status.gpu.available && (
          <div className="jp-cedana-note">
            No GPU: {status.gpu.reason ?? 'none found'}. Kernels are still
            suspended to disk.
          </div>
        )}
        {status?.budget && status.budget.orphaned_images > 0 && (
          <div
            className="jp-cedana-note jp-cedana-orphans"
            title={status.budget.orphaned_kernel_ids.join('\n')}
          >
            {orphansText(status.budget)}
          </div>
        )}
        {model.error && (
          <div className="jp-cedana-warning jp-cedana-load-error">
            {model.error}
          </div>
        )}
        {!model.loaded && !model.error ? (
          <div className="jp-cedana-muted">Loading…</div>
        ) : kernels.length === 0 ? (
          <div className="jp-cedana-muted jp-cedana-empty">
            No kernels are running.
          </div>
        ) : (
          <ul className="jp-cedana-kernels">
            {kernels.map(kernel => (
              <KernelCard
                key={kernel.id}
                model={model}
                kernel={kernel}
                path={paths.get(kernel.id) ?? null}
              />
            ))}
          </ul>
        )}
      </div>
    );
  }

  private _onChange(): void {
    this.update();
  }

  private _startTicker(): void {
    if (this._ticker === null) {
      this._ticker = setInterval(() => this.update(), 1000);
    }
  }

  private _stopTicker(): void {
    if (this._ticker !== null) {
      clearInterval(this._ticker);
      this._ticker = null;
    }
  }

  private _ticker: ReturnType<typeof setInterval> | null = null;
}
