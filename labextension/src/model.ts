/**
 * The frontend model: every kernel's suspend state, kept fresh by the
 * server's events with a polling fallback.
 */
import { ServerConnection, Session } from '@jupyterlab/services';
import { IDisposable } from '@lumino/disposable';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import * as api from './request';
import {
  EVENT_SCHEMA_ID,
  IKernel,
  IKernelStateEvent,
  IStatus,
  KernelState,
  Tier
} from './types';

/** Where the model finds the notebook (session) path of each kernel. */
export interface ISessionSource {
  running(): IterableIterator<Session.IModel>;
  readonly runningChanged: ISignal<any, Session.IModel[]>;
}

/** Where the model hears the server's events (`app.serviceManager.events`). */
export interface IEventSource {
  readonly stream: ISignal<any, { schema_id: string; [key: string]: any }>;
}

/** The totals shown at the top of the panel and in the status bar. */
export interface ISummary {
  /** Kernels suspended now. */
  suspended: number;
  /** GPU memory freed by the suspended kernels. */
  gpuMemoryFreed: number;
  /** GPU memory used by the running kernels. */
  gpuMemoryInUse: number;
  /** Disk used by checkpoints. */
  checkpointBytes: number;
  /** Every kernel. */
  total: number;
}

/** The default refresh interval, in seconds. */
export const DEFAULT_REFRESH_INTERVAL = 10;

/** States in which a kernel changes by itself soon. */
const TRANSITIONAL: ReadonlySet<KernelState> = new Set<KernelState>([
  'suspending',
  'resuming'
]);

/**
 * The kernels of the server with their suspend state.
 */
export class CedanaModel implements IDisposable {
  constructor(options: CedanaModel.IOptions = {}) {
    this.serverSettings =
      options.serverSettings ?? ServerConnection.makeSettings();
    this._sessions = options.sessions ?? null;
    this._events = options.events ?? null;
    this._transitionalDelay = options.transitionalDelay ?? 1000;
    this._debounceDelay = options.debounceDelay ?? 200;
    const interval = Math.max(
      1,
      options.refreshInterval ?? DEFAULT_REFRESH_INTERVAL
    );
    this._refreshInterval = interval;
    this._poll = new Poll({
      auto: false,
      factory: () => this._fetchAll(),
      frequency: CedanaModel.frequency(interval),
      name: 'jupyter-cedana:kernels',
      standby: options.standby ?? 'when-hidden'
    });
    this._sessions?.runningChanged.connect(this._onSessionsChanged, this);
    this._events?.stream.connect(this._onEvent, this);
    if (options.autoStart !== false) {
      void this._poll.start();
    }
  }

  /** The settings used for every request. */
  readonly serverSettings: ServerConnection.ISettings;

  /** Emitted whenever anything shown changes. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /**
   * Emitted when the server reports a failure that none of this model's own
   * requests caused (e.g. a resume on the next message failed).
   */
  get failed(): ISignal<this, CedanaModel.IFailure> {
    return this._failed;
  }

  /** Whether the model is disposed. */
  get isDisposed(): boolean {
    return this._isDisposed;
  }

  /** Whether at least one refresh succeeded. */
  get loaded(): boolean {
    return this._loaded;
  }

  /** The error of the last refresh, or null when it succeeded. */
  get error(): string | null {
    return this._error;
  }

  /** The server's `GET /api/cedana/status`, once known. */
  get status(): IStatus | null {
    return this._status;
  }

  /** The refresh interval of the polling fallback, in seconds. */
  get refreshInterval(): number {
    return this._refreshInterval;
  }
  set refreshInterval(seconds: number) {
    const interval = Math.max(1, seconds);
    if (interval === this._refreshInterval) {
      return;
    }
    this._refreshInterval = interval;
    this._poll.frequency = CedanaModel.frequency(interval);
  }

  /** The polling fallback (exposed for tests and tuning). */
  get poll(): Poll {
    return this._poll;
  }

  /** Every kernel, those with a notebook first, sorted by path. */
  get kernels(): IKernel[] {
    const list = Array.from(this._kernels.values());
    const paths = this.paths();
    return list.sort((a, b) => {
      const pa = paths.get(a.id);
      const pb = paths.get(b.id);
      if (pa && pb) {
        return pa.localeCompare(pb);
      }
      if (pa || pb) {
        return pa ? -1 : 1;
      }
      return a.id.localeCompare(b.id);
    });
  }

  /** One kernel, or undefined. */
  get(kernelId: string): IKernel | undefined {
    return this._kernels.get(kernelId);
  }

  /** Kernel id → notebook (session) path, from the session manager. */
  paths(): Map<string, string> {
    const result = new Map<string, string>();
    if (!this._sessions) {
      return result;
    }
    for (const session of this._sessions.running()) {
      if (session.kernel && !result.has(session.kernel.id)) {
        result.set(session.kernel.id, session.path);
      }
    }
    return result;
  }

  /** The notebook (session) path of a kernel, or null. */
  pathOf(kernelId: string): string | null {
    return this.paths().get(kernelId) ?? null;
  }

  /** Whether one of this model's own requests on the kernel is in flight. */
  isPending(kernelId: string): boolean {
    return this._pending.has(kernelId);
  }

  /** The request in flight on a kernel, or null. */
  pendingAction(kernelId: string): CedanaModel.Action | null {
    return this._pending.get(kernelId) ?? null;
  }

  /** The GPU memory of a kernel's processes, summed over its GPUs. */
  gpuMemory(kernel: IKernel): number {
    return (kernel.gpus ?? []).reduce(
      (sum, gpu) => sum + (gpu.memory_bytes || 0),
      0
    );
  }

  /**
   * The GPU memory a suspended kernel freed: what the server's event said,
   * else what its GPUs held (as reported, or last seen while it ran).
   */
  gpuMemoryFreed(kernel: IKernel): number {
    if (kernel.state !== 'suspended') {
      return 0;
    }
    const fromEvent = this._freed.get(kernel.id);
    if (fromEvent !== undefined) {
      return fromEvent;
    }
    const reported = this.gpuMemory(kernel);
    if (reported > 0) {
      return reported;
    }
    return this._lastGpuMemory.get(kernel.id) ?? 0;
  }

  /** The totals. */
  get summary(): ISummary {
    let suspended = 0;
    let gpuMemoryFreed = 0;
    let gpuMemoryInUse = 0;
    let checkpointBytes = 0;
    for (const kernel of this._kernels.values()) {
      if (kernel.state === 'suspended') {
        suspended++;
        gpuMemoryFreed += this.gpuMemoryFreed(kernel);
      } else {
        gpuMemoryInUse += this.gpuMemory(kernel);
      }
      checkpointBytes += kernel.checkpoint_bytes || 0;
    }
    if (this._status && typeof this._status.bytes_used === 'number') {
      checkpointBytes = Math.max(checkpointBytes, this._status.bytes_used);
    }
    return {
      suspended,
      gpuMemoryFreed,
      gpuMemoryInUse,
      checkpointBytes,
      total: this._kernels.size
    };
  }

  /** The server's clock now, estimated from the last answer (ms since epoch). */
  serverNow(): number {
    return Date.now() + this._clockOffset;
  }

  /** Seconds left before automatic suspend, or null when none is planned. */
  secondsUntilSuspend(kernel: IKernel): number | null {
    if (kernel.state !== 'running' || !kernel.suspend_at) {
      return null;
    }
    const at = Date.parse(kernel.suspend_at);
    if (isNaN(at)) {
      return null;
    }
    return Math.max(0, (at - this.serverNow()) / 1000);
  }

  /** Seconds left of a keep-awake, or null when there is none. */
  keepAwakeSecondsLeft(kernel: IKernel): number | null {
    if (!kernel.keep_awake_until) {
      return null;
    }
    const until = Date.parse(kernel.keep_awake_until);
    if (isNaN(until)) {
      return null;
    }
    const left = (until - this.serverNow()) / 1000;
    return left > 0 ? left : null;
  }

  /** The idle time of a kernel now, in seconds. */
  idleSeconds(kernel: IKernel): number {
    const fetched = this._fetchedAt.get(kernel.id);
    const base = kernel.idle_seconds || 0;
    if (fetched === undefined || kernel.execution_state === 'busy') {
      return base;
    }
    return base + Math.max(0, (Date.now() - fetched) / 1000);
  }

  /** Fetch every kernel and the status now. */
  async refresh(): Promise<void> {
    if (this._isDisposed) {
      return;
    }
    try {
      await this._fetchAll();
    } catch {
      // Already recorded in `error`.
    }
  }

  /** Fetch one kernel now (dropping it when the server no longer has it). */
  async refreshKernel(kernelId: string): Promise<IKernel | undefined> {
    try {
      const kernel = await api.getKernel(kernelId, this.serverSettings);
      this._update(kernel);
      this._changed.emit();
      this._scheduleTransitional();
      return kernel;
    } catch (error) {
      if (error instanceof api.CedanaAPIError && error.status === 404) {
        this._remove(kernelId);
        this._changed.emit();
        return undefined;
      }
      throw error;
    }
  }

  /** Suspend a kernel; rejects with a `CedanaAPIError` carrying the reason. */
  suspend(
    kernelId: string,
    options: api.ISuspendOptions = {}
  ): Promise<IKernel> {
    return this._act(kernelId, 'suspend', 'suspending', () =>
      api.suspendKernel(kernelId, options, this.serverSettings)
    );
  }

  /** Resume a kernel; rejects with a `CedanaAPIError` carrying the reason. */
  resume(kernelId: string, options: api.IResumeOptions = {}): Promise<IKernel> {
    return this._act(kernelId, 'resume', 'resuming', () =>
      api.resumeKernel(kernelId, options, this.serverSettings)
    );
  }

  /** Keep a kernel awake for `seconds` from now (0 clears it). */
  keepAwake(kernelId: string, seconds: number): Promise<IKernel> {
    return this._act(kernelId, 'keep-awake', null, () =>
      api.keepAwake(kernelId, seconds, this.serverSettings)
    );
  }

  /**
   * Note that the user ran code on a suspended kernel: the server restores it
   * now, so show it as resuming until the server says otherwise.
   */
  noteExecution(kernelId: string): void {
    const kernel = this._kernels.get(kernelId);
    if (!kernel || kernel.state !== 'suspended') {
      return;
    }
    this._kernels.set(kernelId, {
      ...kernel,
      state: 'resuming',
      progress: kernel.progress ?? {
        phase: 'restore',
        fraction: 0,
        bytes_done: 0,
        bytes_total: kernel.checkpoint_bytes || null
      }
    });
    this._changed.emit();
    this._scheduleTransitional();
  }

  /** Apply one of the server's events (from `events.stream`). */
  handleEvent(emission: { schema_id: string; [key: string]: any }): void {
    if (this._isDisposed || emission.schema_id !== EVENT_SCHEMA_ID) {
      return;
    }
    const event = emission as unknown as IKernelStateEvent;
    const id = event.kernel_id;
    if (typeof id !== 'string') {
      return;
    }
    this._eventsSeen = true;
    const kernel = this._kernels.get(id);
    if (kernel) {
      this._kernels.set(id, CedanaModel.applyEvent(kernel, event));
    }
    switch (event.action) {
      case 'suspended':
        if (typeof event.gpu_memory_freed_bytes === 'number') {
          this._freed.set(id, event.gpu_memory_freed_bytes);
        }
        break;
      case 'resumed':
        this._freed.delete(id);
        break;
      case 'failed':
        if (!this._pending.has(id)) {
          this._failed.emit({
            kernelId: id,
            path: this.pathOf(id),
            message: event.reason || 'The operation failed.'
          });
        }
        break;
      default:
        break;
    }
    this._changed.emit();
    if (event.action !== 'progress' || !kernel) {
      this._scheduleKernelRefresh(id);
    }
  }

  /** Whether at least one event of ours arrived. */
  get eventsSeen(): boolean {
    return this._eventsSeen;
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    this._poll.dispose();
    if (this._transitionalTimer !== null) {
      clearTimeout(this._transitionalTimer);
    }
    if (this._sessionTimer !== null) {
      clearTimeout(this._sessionTimer);
    }
    for (const timer of this._kernelTimers.values()) {
      clearTimeout(timer);
    }
    this._kernelTimers.clear();
    this._sessions?.runningChanged.disconnect(this._onSessionsChanged, this);
    this._events?.stream.disconnect(this._onEvent, this);
    Signal.clearData(this);
  }

  private async _fetchAll(): Promise<void> {
    if (this._isDisposed) {
      return;
    }
    try {
      const [kernels, status] = await Promise.all([
        api.listKernels(this.serverSettings),
        api.getStatus(this.serverSettings).catch(() => this._status)
      ]);
      if (this._isDisposed) {
        return;
      }
      const seen = new Set<string>();
      for (const kernel of kernels) {
        seen.add(kernel.id);
        this._update(kernel);
      }
      for (const id of Array.from(this._kernels.keys())) {
        if (!seen.has(id)) {
          this._remove(id);
        }
      }
      this._status = status ?? null;
      this._error = null;
      this._loaded = true;
      this._changed.emit();
      this._scheduleTransitional();
    } catch (error) {
      const message = (error as Error).message ?? String(error);
      if (message !== this._error) {
        this._error = message;
        this._changed.emit();
      }
      throw error;
    }
  }

  private async _act(
    kernelId: string,
    action: CedanaModel.Action,
    optimistic: KernelState | null,
    request: () => Promise<IKernel>
  ): Promise<IKernel> {
    if (this._pending.has(kernelId)) {
      throw new api.CedanaAPIError(
        `A ${this._pending.get(kernelId)} of this kernel is already in progress.`,
        'conflict',
        409
      );
    }
    this._pending.set(kernelId, action);
    const before = this._kernels.get(kernelId);
    if (before && optimistic) {
      this._kernels.set(kernelId, { ...before, state: optimistic });
    }
    this._changed.emit();
    try {
      const kernel = await request();
      this._update(kernel);
      return kernel;
    } catch (error) {
      // The server tells what the kernel is now (failed, or as it was).
      try {
        await this.refreshKernel(kernelId);
      } catch {
        if (before) {
          this._kernels.set(kernelId, before);
        }
      }
      throw error;
    } finally {
      this._pending.delete(kernelId);
      this._changed.emit();
      this._scheduleTransitional();
    }
  }

  private _update(kernel: IKernel): void {
    const now = Date.now();
    this._fetchedAt.set(kernel.id, now);
    if (kernel.last_activity) {
      const last = Date.parse(kernel.last_activity);
      if (!isNaN(last) && typeof kernel.idle_seconds === 'number') {
        // The server's now is last_activity + idle_seconds.
        this._clockOffset = last + kernel.idle_seconds * 1000 - now;
      }
    }
    const gpu = this.gpuMemory(kernel);
    if (kernel.state === 'running' && gpu > 0) {
      this._lastGpuMemory.set(kernel.id, gpu);
    }
    if (kernel.state === 'running') {
      this._freed.delete(kernel.id);
    }
    this._kernels.set(kernel.id, kernel);
  }

  private _remove(kernelId: string): void {
    this._kernels.delete(kernelId);
    this._fetchedAt.delete(kernelId);
    this._freed.delete(kernelId);
    this._lastGpuMemory.delete(kernelId);
  }

  private _onEvent(
    _: unknown,
    emission: { schema_id: string; [key: string]: any }
  ): void {
    this.handleEvent(emission);
  }

  private _onSessionsChanged(): void {
    this._changed.emit();
    // A new session may have started a kernel we do not know yet.
    if (this._poll.isDisposed) {
      return;
    }
    if (this._sessionTimer !== null) {
      clearTimeout(this._sessionTimer);
    }
    this._sessionTimer = setTimeout(() => {
      this._sessionTimer = null;
      void this.refresh();
    }, this._debounceDelay);
  }

  private _scheduleKernelRefresh(kernelId: string): void {
    const existing = this._kernelTimers.get(kernelId);
    if (existing !== undefined) {
      clearTimeout(existing);
    }
    this._kernelTimers.set(
      kernelId,
      setTimeout(() => {
        this._kernelTimers.delete(kernelId);
        if (this._isDisposed) {
          return;
        }
        const known = this._kernels.has(kernelId);
        const done = known
          ? this.refreshKernel(kernelId).then(() =>
              api.getStatus(this.serverSettings).then(status => {
                this._status = status;
                this._changed.emit();
              })
            )
          : this.refresh();
        done.catch(() => undefined);
      }, this._debounceDelay)
    );
  }

  /** While a kernel suspends or resumes, refresh often to show progress. */
  private _scheduleTransitional(): void {
    if (this._isDisposed || this._transitionalTimer !== null) {
      return;
    }
    const busy = Array.from(this._kernels.values()).some(
      k => (TRANSITIONAL.has(k.state) || k.queued) && !this._pending.has(k.id)
    );
    if (!busy) {
      return;
    }
    this._transitionalTimer = setTimeout(() => {
      this._transitionalTimer = null;
      void this.refresh();
    }, this._transitionalDelay);
  }

  private _changed = new Signal<this, void>(this);
  private _failed = new Signal<this, CedanaModel.IFailure>(this);
  private _isDisposed = false;
  private _loaded = false;
  private _error: string | null = null;
  private _status: IStatus | null = null;
  private _kernels = new Map<string, IKernel>();
  private _fetchedAt = new Map<string, number>();
  private _freed = new Map<string, number>();
  private _lastGpuMemory = new Map<string, number>();
  private _pending = new Map<string, CedanaModel.Action>();
  private _kernelTimers = new Map<string, ReturnType<typeof setTimeout>>();
  private _transitionalTimer: ReturnType<typeof setTimeout> | null = null;
  private _sessionTimer: ReturnType<typeof setTimeout> | null = null;
  private _clockOffset = 0;
  private _eventsSeen = false;
  private _refreshInterval: number;
  private _transitionalDelay: number;
  private _debounceDelay: number;
  private _poll: Poll;
  private _sessions: ISessionSource | null;
  private _events: IEventSource | null;
}

export namespace CedanaModel {
  /** What the model asks the server to do. */
  export type Action = 'suspend' | 'resume' | 'keep-awake';

  export interface IOptions {
    serverSettings?: ServerConnection.ISettings;
    /** The session manager, for notebook paths. */
    sessions?: ISessionSource;
    /** The event manager, for live updates. */
    events?: IEventSource;
    /** Seconds between polls (the fallback to events); default 10. */
    refreshInterval?: number;
    /** Start polling at once (default true). */
    autoStart?: boolean;
    /** When polling pauses; default 'when-hidden'. */
    standby?: Poll.Standby;
    /** Milliseconds between refreshes while a kernel suspends or resumes. */
    transitionalDelay?: number;
    /** Milliseconds to gather events before refreshing a kernel. */
    debounceDelay?: number;
  }

  /** A failure reported by the server's events. */
  export interface IFailure {
    kernelId: string;
    path: string | null;
    message: string;
  }

  /** The poll frequency for a refresh interval in seconds. */
  export function frequency(seconds: number): {
    interval: number;
    backoff: boolean;
    max: number;
  } {
    const interval = seconds * 1000;
    return { interval, backoff: true, max: Math.max(interval * 6, 60000) };
  }

  /** A kernel with an event applied to it. */
  export function applyEvent(
    kernel: IKernel,
    event: IKernelStateEvent
  ): IKernel {
    const next: IKernel = { ...kernel };
    const states: Record<string, KernelState> = {
      suspending: 'suspending',
      suspended: 'suspended',
      resuming: 'resuming',
      resumed: 'running',
      failed: 'failed'
    };
    if (event.state) {
      next.state = event.state;
    } else if (states[event.action]) {
      next.state = states[event.action];
    }
    if (event.tier !== undefined) {
      next.tier = event.tier as Tier | null;
    }
    if (event.action === 'resumed') {
      next.tier = null;
    }
    if (event.progress !== undefined) {
      next.progress = event.progress;
    }
    if (
      event.action === 'suspended' ||
      event.action === 'resumed' ||
      event.action === 'failed'
    ) {
      next.progress = null;
    }
    if (typeof event.checkpoint_bytes === 'number') {
      next.checkpoint_bytes = event.checkpoint_bytes;
    }
    if (typeof event.duration_seconds === 'number') {
      if (event.action === 'suspended') {
        next.last_suspend_seconds = event.duration_seconds;
      } else if (event.action === 'resumed') {
        next.last_resume_seconds = event.duration_seconds;
      }
    }
    if (event.action === 'failed' && event.reason) {
      next.reason = event.reason;
    } else if (event.action === 'resumed') {
      // A failure's reason no longer holds; a resume from an older image says so.
      next.reason = event.reason ?? null;
    }
    if (event.action === 'queued') {
      // The event says what waits (in `reason`); a refresh tells where in line.
      next.queued = {
        action: event.reason === 'resume' ? 'resume' : 'suspend',
        position: kernel.queued?.position ?? 1,
        since: kernel.queued?.since ?? null
      };
    } else if (event.action !== 'progress' && event.action !== 'keep-awake') {
      next.queued = null;
    }
    if (event.action === 'suspended' || event.action === 'resumed') {
      next.backoff = null;
    }
    return next;
  }
}
